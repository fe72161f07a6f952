"""Which layers are tensor parallel: smp.tensor_parallelism() and smp.set_tensor_parallelism().

Only marks modules; DistributedModel turns the marks into a plan once it knows the stage each module
lands on. The mark is an attribute on the module so that it follows the module into any container.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch import nn

MARK = "_hpkit_smp_tensor_parallel"
# The layer types with a tensor-parallel form here (SMP's distributable modules, torch-native).
TP_TYPES = (nn.Linear, nn.Embedding)

_local = threading.local()


def _stack() -> list[bool]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _on_module_created(module: nn.Module, *_args: object) -> None:
    if _stack() and isinstance(module, TP_TYPES):
        setattr(module, MARK, _stack()[-1])


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: object) -> Iterator[None]:
    """Marks every nn.Linear / nn.Embedding created inside the block (innermost block wins)."""
    if kwargs:
        from hpkit.compat.smp.unsupported import stop

        stop(
            f"smp.tensor_parallelism({', '.join(kwargs)}=...)",
            "drop the keyword arguments: layers are split with torch's ColwiseParallel/RowwiseParallel",
        )
    _stack().append(enabled)
    # A forward pre-hook cannot see construction; a global module registration hook sees every
    # parameter registered, which happens in each layer's __init__.
    handle = nn.modules.module.register_module_parameter_registration_hook(_on_param_registered)
    try:
        yield
    finally:
        handle.remove()
        _stack().pop()


def _on_param_registered(module: nn.Module, _name: str, _param: object) -> None:
    _on_module_created(module)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: object) -> None:
    """Marks `module` and the nn.Linear / nn.Embedding modules under it."""
    if kwargs:
        from hpkit.compat.smp.unsupported import stop

        stop(
            f"smp.set_tensor_parallelism({', '.join(kwargs)}=...)",
            "drop the keyword arguments: layers are split with torch's ColwiseParallel/RowwiseParallel",
        )
    for sub in module.modules():
        if isinstance(sub, TP_TYPES):
            setattr(sub, MARK, enabled)


def is_marked(module: nn.Module) -> bool:
    return bool(getattr(module, MARK, False))
