"""Each local Slurm cluster of the suite, on its own controller port and job-id range.

Job scripts derive their rendezvous port from the job id (hpkit.rendezvous: 29500 + id % 3000), so two
clusters whose job ids meet modulo 3000 would also meet on rendezvous ports. Every cluster therefore gets a
slot: ports `base + 100 * worker + offset` and job ids `base + 1000 * worker + offset`, where `worker` is
the pytest-xdist worker (gw0, gw1, gw2; 0 without xdist) and the bases are HPKIT_TEST_CLUSTER_PORT /
HPKIT_TEST_FIRST_JOB_ID. Offsets leave each cluster 10 ports (a controller and up to 9 nodes) and 10 to
350 job ids; "scale" (64 nodes, test_cluster_scale.py) takes 65 ports past the others' 300 (offset 300: its
workers' ranges, 100 apart, do not meet). Three workers fill the 3000 rendezvous ports: two checkouts
testing on one host at once share them, and can collide.
"""

from __future__ import annotations

import os
from typing import NamedTuple

WORKER_PORT_STRIDE = 100
WORKER_JOB_ID_STRIDE = 1000
MAX_WORKERS = 3  # 3 * 1000 job ids: one rendezvous port each (hpkit.rendezvous.PORT_SPAN)

# cluster name -> (port offset, job-id offset)
OFFSETS = {
    "session": (0, 0),  # 350 job ids
    "slurm-24.11": (80, 350),  # 50 job ids: the session's Slurm 24.11 cluster (tests marked slurm_24_11)
    "node-loss": (10, 400),
    "all-nodes": (20, 500),
    "polling": (30, 600),
    "forgotten": (40, 700),  # 25 job ids
    "accounting": (
        370,
        725,
    ),  # 10 ports past "scale"'s 65 (its workers' ranges, 100 apart, do not meet), 25 job ids
    "dev-cluster": (50, 750),  # 15 job ids (it submits none)
    "scale": (300, 765),  # 65 ports (controller + 64 nodes) and 10 job ids: test_cluster_scale.py
    "node-network": (90, 775),  # 25 job ids: NET=netns, an address per node (test_node_network.py)
    "why": (60, 800),
    "oci": (70, 900),  # 100 job ids: the next worker's slots start at 1000
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
