"""Real torch.distributed for unit tests: `world` processes on this host joined by one gloo group.

`run_ranks(fn, world, tmp_path, *args)` starts the processes (torch.multiprocessing), joins them through a
FileStore under tmp_path (no port to pick, so two xdist workers never collide), and runs `fn(rank, world,
*args)` in each. An assertion or error in any rank fails the test with that rank's traceback.

Start method fork: the ranks inherit the imported torch and hpkit. Spawned ranks import torch again, which
took 15-20 s each on the loaded 2-core machine (0.3 s forked, for the same launch). What fork risks is
handled: each rank sets one intra-op thread before any torch op (a forked child must not enter the OpenMP
pool its parent made; torch's own DataLoader workers do the same), and the parent has no gloo group to copy.

A rank left waiting in a collective (the bug such a test looks for may be exactly that) ends after
COLLECTIVE_TIMEOUT_S with gloo's timeout error instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpkit.runtime.env import groups_inherit_timeout

COLLECTIVE_TIMEOUT_S = 60


def run_ranks(fn: Callable[..., None], world: int, tmp_path: Path, *args: Any) -> None:
    store = tmp_path / f"gloo-store-{fn.__name__}"
    mp.start_processes(
        _rank_main, args=(fn, world, str(store), args), nprocs=world, join=True, start_method="fork"
    )


def _rank_main(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple[Any, ...]) -> None:
    # First: no OpenMP pool inherited from the parent is entered (see the module's docstring); and one
    # thread per rank keeps the ranks from fighting over a 2-core machine.
    torch.set_num_threads(1)
    # Loopback: the test host's name may not resolve to an address the ranks can reach each other on.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout
    )
    groups_inherit_timeout(timeout)  # DeviceMesh's groups too, as hpkit train's own start-up does
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
