"""resilience.keep_survivors: a rank whose process group broke under it (a peer lost) leaves the group and stays in
its process, parked, for the next step (hpkit.warm.park) instead of ending: that step's rank on this node takes the
process over, and `hpkit train` runs again in it with that step's environment. Kept: the imports, a GPU's
context, compiled kernels; rebuilt as in a new process: the process group, the model, the state (restored from
the in-memory or the persistent checkpoint as any restart's).

Only a failure of the group itself counts (a peer's sockets closed, a communicator aborted): a rank blocked in a
collective that cannot be interrupted (a cut link under gloo) never gets here, and its node's zygote kills it
when the step ends; any other error ends the rank as before."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from hpkit.job_events import stays_line
from hpkit.runtime.config import RunConfig
from hpkit.runtime.env import node_name
from hpkit.warm import park

# What a peer's loss says where the backend names it as an error of its own class (gloo's is a RuntimeError).
GROUP_BROKE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "ncclSystemError",
)
# How long the old run's own threads (an async save's writer, the in-memory tier's copier) have to end: a process
# that still runs them when the next step takes it over would run two runs at once.
THREADS_END_S = 10.0


def offer(cfg: RunConfig) -> None:
    """Say to the zygote, at the run's start, that this rank may stay (it waits for it to park, not kill it), and
    have its word that the step ended (park.STEP_ENDED_SIGNAL) end the run at the next step."""
    if may_stay(cfg):
        park.watch_step_end()
        park.offer()


def leave_if_step_ended() -> None:
    """Before each step: a rank whose step has ended (its client gone, its group maybe whole) trains no further."""
    if park.step_ended:
        raise park.StepEnded("its step ended while its group still worked (the launcher's process is gone)")


def why_leaving(exc: BaseException) -> str | None:
    """Why a run that `exc` ended leaves for the next step: its step ended, or its group broke; None otherwise."""
    if isinstance(exc, park.StepEnded):
        return str(exc)
    broke = group_broke(exc)
    return f"its process group broke ({broke})" if broke is not None else None


def may_stay(cfg: RunConfig) -> bool:
    """Whether this rank stays in its process when its group breaks: a zygote forked it, and the run's survivors
    stay."""
    return park.available() and survivors_stay(cfg)


def survivors_stay(cfg: RunConfig) -> bool:
    """Whether the run's survivors stay (keep_survivors, or its default for the ranks' device): alike on every
    rank, where whether a zygote forked this one is not (one that none answered starts cold)."""
    return cfg.resilience.survivors_stay(on_gpus=torch.cuda.is_available())


def ranks_that_stayed() -> int:
    """How many of the run's ranks stayed in their processes from an earlier step (a collective: every rank)."""
    count = torch.tensor([1 if park.adopted_at is not None else 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        count = count.cuda()
    dist.all_reduce(count)
    return int(count.item())


def group_broke(exc: BaseException) -> str | None:
    """The first line of the error that says the process group broke, in `exc` or what caused it; None for any
    other error."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, dist.DistError) or (
            isinstance(error, RuntimeError) and any(words in text for words in GROUP_BROKE)
        ):
            first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
            return first[:300]
        error = error.__cause__ or error.__context__
    return None


def stay_for_next_step(cfg: RunConfig, exc: BaseException) -> bool:
    """Whether this rank, its run ended by `exc`, stays in its process and has been taken over by the next step
    (then `hpkit train` runs again); False to end as without keep_survivors."""
    if not may_stay(cfg):
        return False
    why = why_leaving(exc)
    if why is None:
        return False
    rank, node = int(os.environ.get("RANK", "-1")), node_name()
    running = _threads_left(THREADS_END_S)
    if running:
        with contextlib.suppress(OSError):
            print(
                f"hpkit train: rank {rank} on {node} cannot stay in its process: thread(s) {', '.join(running)} of "
                f"the run still run {THREADS_END_S:.0f} s after it ended ({why}); ending",
                file=sys.stderr,
                flush=True,
            )
        return False
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError):  # the step's pipes may be gone with its launcher
        print(stays_line(rank, node, os.getpid(), why), file=sys.stderr, flush=True)
    if not park.stay():
        return False
    # Taken over; what the old run's last daemon threads may have cached meanwhile goes too.
    forget_the_run()
    return True


def forget_the_run() -> None:
    """Drop what torch keeps per process across runs and would hand the next run stale: a DeviceMesh compares equal
    to another of the same shape whatever this process's rank in it, so a cache keyed by meshes or DTensor specs
    answers the new run with the old run's mesh, and its coordinate (this rank's old place). Measured on a rank
    that stayed as rank 1 and came back as rank 0: its parameters' specs (from DTensor's sharding-propagation
    caches, the C++ fast path's and the Python one) kept the old mesh, and every save's plan put its shards at
    rank 1's offsets. DCP also caches each planner class's save plans for the process (SavePlanner._cached_*)."""
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.tensor import _redistribute, debug

    for name, value in vars(SavePlanner).items():
        if name.startswith("_cached_") and isinstance(value, dict):
            value.clear()
    debug._clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    clear_distributed_lru_caches()
    gc.collect()  # what the caches held, cycles included (a mesh and its groups), goes now, not at some later pass


def clear_distributed_lru_caches() -> int:
    """Empty every functools cache of torch.distributed's loaded modules and their classes; how many. Some are keyed
    by DeviceMesh (_redistribute._gen_transform_infos, MeshTopoInfo.build_from_mesh, ...), so besides answering the
    next run with the old mesh, they hold it, and the mesh its process groups: a rank that stayed kept the broken
    run's groups, their threads and sockets (9 gloo threads per step stayed through in test_stay_in_process, whose
    run has three groups). Every cache, not a list of them: a torch release that adds one is covered, and an
    emptied cache only recomputes."""
    cleared = 0
    with (
        warnings.catch_warnings()
    ):  # a deprecated module attribute (torch.distributed.reduce_op) warns when looked at
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith("torch.distributed"):
                continue
            for value in list(vars(module).values()):
                owners = [value, *vars(value).values()] if isinstance(value, type) else [value]
                for owner in owners:
                    function = owner.__func__ if isinstance(owner, (staticmethod, classmethod)) else owner
                    if isinstance(
                        function, functools._lru_cache_wrapper
                    ):  # functools.cache and lru_cache alike
                        function.cache_clear()
                        cleared += 1
    return cleared


def _threads_left(within_s: float) -> list[str]:
    """The names of the threads other than this one that do not end within `within_s` (daemon threads of a
    broken group's own, which end with the process, are not waited for)."""
    deadline = time.monotonic() + within_s
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
    return [
        t.name
        for t in threading.enumerate()
        if t is not threading.current_thread() and not t.daemon and t.is_alive()
    ]
