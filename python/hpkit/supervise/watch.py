"""The hang watchdog's store under `launcher: srun | mpi` (hpkit.watch_store): served here, outside the
training processes, once for the whole job, and named in every step's environment."""

from __future__ import annotations

import importlib.util
from typing import Any

from hpkit import job_events as ev
from hpkit.supervise.machine import Supervisor
from hpkit.watch_store import STORE_ENV, export, serve


def serve_watch_store(supervisor: Supervisor) -> Any:
    """The store (to keep alive), or None: under torchrun hpkit-torchrun serves it; a job that is not hpkit
    train's (or has the watchdog off) needs none; without torch the ranks fall back to the store rank 0 serves."""
    if not supervisor.plan.watch_store:
        return None
    if STORE_ENV in supervisor.env:
        # The job names its own store (the spec's env): it keeps it ("" leaves the ranks their fallback).
        supervisor.event(ev.WATCH_STORE, address=supervisor.env[STORE_ENV], named_by_job=True)
        return None
    if importlib.util.find_spec("torch") is None:
        supervisor.say(
            "torch does not import on the batch host: the hang watchdog's ranks use rank 0's store"
        )
        supervisor.event(ev.WATCH_STORE, error="torch does not import on the batch host")
        return None
    try:
        store, port = serve()
    except Exception as exc:  # any failure to serve leaves the ranks their fallback
        supervisor.say(f"could not serve the hang watchdog's store ({exc}): its ranks use rank 0's store")
        supervisor.event(ev.WATCH_STORE, error=str(exc))
        return None
    node = supervisor.run_.batch_host
    host = supervisor.cluster.node_addr(node) if node else "127.0.0.1"
    export(supervisor.env, host, port, node)
    supervisor.event(ev.WATCH_STORE, address=f"{host}:{port}", node=node)
    return store
