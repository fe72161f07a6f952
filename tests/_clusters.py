"""Each local Slurm cluster of the suite, on its own controller port and job-id range.

Job scripts derive their rendezvous port from the job id (hpkit.rendezvous: 29500 + id % 20000), so two
clusters whose job ids meet would also meet on rendezvous ports. Every cluster therefore gets a slot:
ports `base + 100 * worker + offset` and job ids `base + 2000 * worker + offset`, where `worker` is the
pytest-xdist worker (gw0, gw1, ...; 0 without xdist) and the bases are HPKIT_TEST_CLUSTER_PORT /
HPKIT_TEST_FIRST_JOB_ID (two checkouts on one host set their own). Offsets leave each cluster 10 ports
(a controller and up to 9 nodes) and 300 job ids (the last two, which submit few jobs, 100 each).
"""

from __future__ import annotations

import os
from typing import NamedTuple

WORKER_PORT_STRIDE = 100
WORKER_JOB_ID_STRIDE = 2000
MAX_WORKERS = 6  # 5000 + 6 * 2000 stays under 20000 apart: no two workers share rendezvous ports

# cluster name -> (port offset, job-id offset)
OFFSETS = {
    "session": (0, 0),
    "node-loss": (10, 300),
    "all-nodes": (20, 600),
    "polling": (30, 900),
    "forgotten": (40, 1200),
    "dev-cluster": (50, 1500),
    "why": (60, 1800),  # 100 job ids
    "oci": (70, 1900),  # 100 job ids: the next worker's slots start at 2000
}


class Slot(NamedTuple):
    port: int
    first_job_id: int


def worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name.removeprefix("gw") or 0)
    if index >= MAX_WORKERS:
        raise RuntimeError(f"{name}: at most {MAX_WORKERS} xdist workers have their own cluster slots")
    return index


def slot(cluster: str) -> Slot:
    port_offset, id_offset = OFFSETS[cluster]
    worker = worker_index()
    port = int(os.environ.get("HPKIT_TEST_CLUSTER_PORT", "7817"))
    first = int(os.environ.get("HPKIT_TEST_FIRST_JOB_ID", "5000"))
    return Slot(
        port + WORKER_PORT_STRIDE * worker + port_offset,
        first + WORKER_JOB_ID_STRIDE * worker + id_offset,
    )
