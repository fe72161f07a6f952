"""Everything a check may read from outside: system roots, environment, timeouts, and shared probes.

The roots are parameters so tests can point checks at fabricated /proc, /sys, /opt trees; the memo lets
checks that run in parallel share one expensive probe (the metadata service) instead of each asking.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PROFILES = ("login", "compute", "container")


@dataclass(frozen=True)
class Roots:
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    opt: Path = Path("/opt")
    etc: Path = Path("/etc")
    var_log: Path = Path("/var/log")
    usr: Path = Path("/usr")
    # This process itself (which libstdc++ the loader mapped): unlike the node's mounts under proc, a
    # prepared system tree cannot describe it, so a sysroot leaves it alone.
    proc_self: Path = Path("/proc/self")
    # The tree that absolute paths found in its files (ld.so.conf) point into: / unless a sysroot.
    tree: Path = Path("/")

    def inside(self, path: str | Path) -> Path:
        """An absolute path named by a file of the tree, as seen from here."""
        return self.tree / str(path).lstrip("/")

    @classmethod
    def under(cls, sysroot: Path) -> Roots:
        """The node's roots inside one prepared system tree (a mounted image, a node's snapshot)."""
        defaults = cls()
        return cls(
            **{
                name: sysroot / str(getattr(defaults, name)).lstrip("/")
                for name in ("proc", "sys", "opt", "etc", "var_log", "usr")
            },
            tree=sysroot,
        )


@dataclass
class Context:
    profile: str = "login"
    roots: Roots = field(default_factory=Roots)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    # Seconds any one subprocess probe (sinfo, srun --help, fi_info, enroot) may take.
    probe_timeout: float = 3.0
    # Seconds the whole metadata-service conversation may take (token, then instance type).
    imds_timeout: float = 0.8
    # Where the shared filesystem should be; None: look for any Lustre/NFS mount.
    shared_fs: Path | None = None
    # Folders whose free space matters (checkpoints, caches); None: $HOME and the temp folder.
    disk_paths: tuple[Path, ...] | None = None
    # Where installed distributions (torch, nvidia-nccl-*) are looked up; None: sys.path.
    python_path: list[str] | None = None
    _memo: dict[str, object] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _key_locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """compute() once per context, even when several checks ask at the same time."""
        with self._lock:
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._memo:
                self._memo[key] = compute()
            return self._memo[key]  # type: ignore[return-value]

    @property
    def search_path(self) -> list[str]:
        return list(sys.path) if self.python_path is None else list(self.python_path)
