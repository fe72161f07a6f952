"""Where the hang watchdog's nodes report: the c10d store the job already runs, named in the environment.

Each node's watchdog sends one summary a second to this store, and one judge reads them all. The store must
live outside the training processes, so that a stopped or frozen rank does not take the channel with it:
- `launcher: torchrun`: the rendezvous store that `hpkit-torchrun` serves on the rendezvous node (it sets
  these variables for its workers);
- `launcher: srun | mpi`: a store that `hpkit.supervise` serves from the batch script, where torch imports
  there (`serve` below); elsewhere the ranks fall back to MASTER_ADDR:MASTER_PORT, the store rank 0 serves.

Torch is imported only by `serve`, so that reading the variables stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STORE_ENV = "HPKIT_WATCH_STORE"  # host:port
STORE_NODE_ENV = "HPKIT_WATCH_STORE_NODE"  # the Slurm node name of the store's host, for the verdict
# Every key the watchdog writes starts with this (the rendezvous store carries torchrun's keys too).
KEY_PREFIX = "hpkit-watch"


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    node: str  # "" where not known
    # Whether the store lives outside the training processes (named by the job) or is the fallback that
    # rank 0's process serves (a stopped rank 0 then freezes it).
    outside_ranks: bool


def address_from_env(env: Mapping[str, str]) -> StoreAddress | None:
    """The watch store named by the job, else the job's own MASTER_ADDR:MASTER_PORT store; None if neither."""
    named = env.get(STORE_ENV, "")
    if named:
        host, _, port = named.rpartition(":")
        if host and port.isdigit():
            return StoreAddress(host.strip("[]"), int(port), env.get(STORE_NODE_ENV, ""), True)
    master, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if master and port.isdigit():
        # torchrun's agent on node 0 serves this one; under srun, rank 0 does.
        return StoreAddress(master, int(port), env.get(STORE_NODE_ENV, ""), "TORCHELASTIC_RUN_ID" in env)
    return None


def export(env: dict[str, str], host: str, port: int, node: str) -> None:
    """Name the watch store for the processes a launcher starts next (they inherit `env`)."""
    env[STORE_ENV] = f"{host}:{port}"
    env[STORE_NODE_ENV] = node


def serve(port: int = 0) -> tuple[Any, int]:
    """A store server in this process (the supervisor's), on `port` or a free one; returns (store, port)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30), use_libuv=True
    )
    return store, int(store.port)
