"""The catalogue of checks: each registers its name, a title, and the profiles it belongs to."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpkit.checks.context import PROFILES, Context
from hpkit.checks.result import Result

if TYPE_CHECKING:
    # Only for the type checker: collections.abc.Callable[...] fails at run time before Python 3.9.
    CheckFn = Callable[[Context], Result]


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    profiles: tuple[str, ...]
    fn: CheckFn


_CHECKS: dict[str, Check] = {}

# Importing a module registers its checks; this order is the report's order: software on the host first,
# then hardware and network, then the cluster around the node.
_MODULES = (
    "python_env",
    "kernel",
    "torch_cuda",
    "libstdcxx",
    "imds",
    "instance_types",
    "network_efa",
    "network_ifname",
    "container",
    "slurm",
    "storage",
)


def check(name: str, title: str, profiles: tuple[str, ...]) -> Callable[[CheckFn], CheckFn]:
    unknown = set(profiles) - set(PROFILES)
    if unknown:
        raise ValueError(f"check {name}: unknown profiles {sorted(unknown)}")

    def register(fn: CheckFn) -> CheckFn:
        if name in _CHECKS:
            raise ValueError(f"check {name} registered twice")
        _CHECKS[name] = Check(name, title, tuple(profiles), fn)
        return fn

    return register


def all_checks() -> dict[str, Check]:
    """Every check, in the order a reader expects: the host's software first, then hardware, then cluster."""
    for module in _MODULES:
        importlib.import_module(f"hpkit.checks.{module}")
    # Modules import each other (the GPU checks read the instance table), so registration order is not
    # module order: sort by module, keeping each module's own order.
    position = {f"hpkit.checks.{m}": i for i, m in enumerate(_MODULES)}
    registered = list(_CHECKS.values())
    ordered = sorted(
        registered, key=lambda c: (position.get(c.fn.__module__, len(position)), registered.index(c))
    )
    return {c.name: c for c in ordered}


def for_profile(profile: str) -> list[Check]:
    return [c for c in all_checks().values() if profile in c.profiles]
