"""Each local Slurm cluster of the suite, on its own controller port and job-id range.

Job scripts derive their rendezvous port from the job id (hpkit.rendezvous: 29500 + id % 3000), so two
clusters whose job ids meet modulo 3000 would also meet on rendezvous ports. Every cluster therefore gets a
slot: ports `base + 200 * worker + offset` and job ids `base + 750 * worker + offset`, where `worker` is
the pytest-xdist worker (gw0 to gw3; 0 without xdist) and the bases are HPKIT_TEST_CLUSTER_PORT /
HPKIT_TEST_FIRST_JOB_ID. Port offsets under 100 leave each cluster 10 ports (a controller and up to 9 nodes);
"scale" (64 nodes, test_cluster_scale.py) takes 65 from 100 and "accounting" 10 from 170. Job-id offsets leave
each cluster 10 to 250 ids, several times what a run submits to it (a fresh-clone run of fb031c8: at most 37 to a
worker's session cluster, 50 to test_slurm_polling's). Four workers fill the 3000 rendezvous ports: two
checkouts testing on one host at once share them, and can collide.
"""

from __future__ import annotations

import os
from typing import NamedTuple

WORKER_PORT_STRIDE = 200
WORKER_JOB_ID_STRIDE = 750
MAX_WORKERS = 4  # 4 * 750 job ids: one rendezvous port each (hpkit.rendezvous.PORT_SPAN)

# cluster name -> (port offset, job-id offset)
OFFSETS = {
    "session": (0, 0),  # 250 job ids
    "slurm-24.11": (80, 250),  # 50 job ids: the session's Slurm 24.11 cluster (tests marked slurm_24_11)
    "node-loss": (10, 300),  # 75 job ids
    "all-nodes": (20, 375),  # 50 job ids
    "polling": (30, 425),  # 75 job ids
    "forgotten": (40, 500),  # 25 job ids
    "accounting": (170, 525),  # 10 ports past "scale"'s 65, 25 job ids
    "dev-cluster": (50, 550),  # 15 job ids (it submits none)
    "scale": (100, 565),  # 65 ports (controller + 64 nodes) and 10 job ids: test_cluster_scale.py
    "node-network": (90, 575),  # 25 job ids: NET=netns, an address per node (test_node_network.py)
    "why": (60, 600),  # 50 job ids
    # 100 job ids (test_oci_jobs.py's clusters take 10 x their port offset): the next worker's start at 750
    "oci": (70, 650),
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
