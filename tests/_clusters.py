"""Each local Slurm cluster of the suite, on its own controller port and job-id range.

Job scripts derive their rendezvous port from the job id (hpkit.rendezvous: 29500 + id % 3000), so two
clusters whose job ids meet modulo 3000 would also meet on rendezvous ports. Every cluster therefore gets a
slot: ports `base + 200 * worker + offset` and job ids `base + 600 * worker + offset`, where `worker` is
the pytest-xdist worker (gw0 to gw4; 0 without xdist) and the bases are HPKIT_TEST_CLUSTER_PORT /
HPKIT_TEST_FIRST_JOB_ID. Port offsets under 100 leave each cluster 10 ports (a controller and up to 9 nodes);
"scale" (64 nodes, test_cluster_scale.py) takes 65 from 100 and "accounting" 10 from 170. Each cluster's job ids
are several times what a run submits to it (a fresh-clone run of faa4fa4, the newest id in each controller's log:
at most 26 to a worker's session cluster, 8 to its 24.11 cluster, 7 to node-loss's, 9 to why's, 10 to each OCI
cluster; test_slurm_polling submits 50). Five workers fill the 3000 rendezvous ports: two checkouts testing on one
host at once share them, and can collide.
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

WORKER_PORT_STRIDE = 200
WORKER_JOB_ID_STRIDE = 600
MAX_WORKERS = 5  # 5 * 600 job ids: one rendezvous port each (hpkit.rendezvous.PORT_SPAN)

# cluster name -> (port offset, job-id offset, job ids)
SLOTS = {
    "session": (0, 0, 150),
    "slurm-24.11": (80, 150, 40),  # the session's Slurm 24.11 cluster (tests marked slurm_24_11)
    "node-loss": (10, 190, 50),
    "all-nodes": (20, 240, 25),
    "polling": (30, 265, 75),
    "forgotten": (40, 340, 15),
    "accounting": (170, 355, 20),  # 10 ports past "scale"'s 65
    "dev-cluster": (50, 375, 10),  # it submits none
    "scale": (100, 385, 10),  # 65 ports (controller + 64 nodes): test_cluster_scale.py
    "node-network": (90, 395, 25),  # NET=netns, an address per node (test_node_network.py)
    "why": (60, 420, 50),
    "oci": (70, 470, 100),  # test_oci_jobs.py's clusters start at 10 x their port offset (0, 3, 6) in it
}


def _check_slots() -> None:
    """The id ranges must not meet, nor run into the next worker's: a cluster's ids are its jobs' rendezvous ports."""
    ranges = sorted((first, first + count, name) for name, (_, first, count) in SLOTS.items())
    for (_, end, name), (first, _, following) in itertools.pairwise(ranges):
        assert end <= first, f"_clusters.SLOTS: {name}'s job ids run into {following}'s"
    assert ranges[-1][1] <= WORKER_JOB_ID_STRIDE, f"_clusters.SLOTS: {ranges[-1][2]}'s ids pass the worker's"


_check_slots()


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
    port_offset, id_offset, _ = SLOTS[cluster]
    worker = worker_index()
    port = int(os.environ.get("HPKIT_TEST_CLUSTER_PORT", "7817"))
    first = int(os.environ.get("HPKIT_TEST_FIRST_JOB_ID", "5000"))
    return Slot(
        port + WORKER_PORT_STRIDE * worker + port_offset,
        first + WORKER_JOB_ID_STRIDE * worker + id_offset,
    )
