"""Let torch.distributed's worker threads finish freeing their last work, at the end of a DDP script on gloo.

A DDP model holds its process group (its C++ Reducer does), so the group outlives `destroy_process_group()`;
and a gloo worker thread frees the last collective's work after that work has completed, which takes the GIL.
Two ways this ends a script that did nothing wrong:

- At exit. If the script has ended by then and the interpreter is finalizing, the thread is killed while it
  unwinds and the process aborts with "terminate called without an active exception". A core shows it: the main
  thread in Py_FinalizeEx, a gloo worker in ~AsyncAllreduceWork -> gil_scoped_acquire -> PyThread_exit_thread.
  On the local cluster the seeds' DDP script did that in 10 of 30 runs. An exit hook that sleeps without the GIL
  hands it to that thread first: 0 of 20.
- Before exit: a hang. When the model is freed after `destroy_process_group()` (it goes out of scope as the
  function that trained returns), the Reducer drops the group's last reference and the group's destructor runs
  there, holding the GIL (torch binds the Reducer without releasing it; the group's own binding does release
  it), and joins the worker threads; a worker still freeing the last work waits for the GIL forever. Stacks:
  main in pybind11_object_dealloc -> ~Reducer -> ~ProcessGroupGloo -> std::thread::join, the worker in
  ~AsyncBarrierWork -> decref_pyobject -> gil_scoped_acquire. The SM_HOSTS example (train(), then its
  caller prints) hung so in 2 of 11 warm runs on the local cluster. So `destroy_process_group` keeps the
  groups it destroys (`_DESTROYED`) until the exit hook lets them go, where the group's binding releases the
  GIL while it is destroyed: a Reducer freed earlier only drops a reference that is not the last.
  Destroyed groups were shut down by torch all the same (`ProcessGroup.shutdown`); only the objects stay.

`install()` patches torch.distributed when it is imported (now, when it already is: a warm start's zygote
imported it; else by an import hook, so that a program that never imports torch pays nothing).
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# Seconds the interpreter waits at exit, without the GIL, before it finalizes.
SETTLE_S = 0.1
C10D = "torch.distributed.distributed_c10d"

_installed = False
# The process groups destroy_process_group() destroyed, kept until exit (see the module's docstring).
_DESTROYED: list[Any] = []
_exiting = False  # the exit hook has run: a group destroyed later (another exit hook) is let go at once


def install() -> None:
    """Register the exit hook and keep destroyed process groups until it runs (idempotent)."""
    global _installed
    if _installed:
        return
    atexit.register(_at_exit)
    if C10D in sys.modules:
        _patch(sys.modules[C10D])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
    _installed = True


def _at_exit() -> None:
    # Last references first (the group's binding releases the GIL while it joins its threads), then the settle.
    global _exiting
    _exiting = True
    _DESTROYED.clear()
    time.sleep(SETTLE_S)


def _patch(c10d: ModuleType) -> None:
    original = c10d.destroy_process_group
    if getattr(original, "hpkit_keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        groups = c10d._world.pg_map
        kept = (
            list(groups)
            if group is None or group == c10d.GroupMember.WORLD
            else [g for g in groups if g is group]
        )
        original(group)
        if not _exiting:
            _DESTROYED.extend(kept)

    destroy_process_group.hpkit_keeps_groups = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    # torch.distributed re-exports it (`from .distributed_c10d import *`): once imported, its copy is patched too.
    package = sys.modules.get("torch.distributed")
    if package is not None and getattr(package, "destroy_process_group", None) is original:
        package.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch.distributed.distributed_c10d is imported, wraps its loader so that the
    module is patched as soon as it has run (torch.distributed's `import *` then takes the patched function)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # by the finders after this one
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self._loader, name)
