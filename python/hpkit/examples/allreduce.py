"""Smoke test for a launch: every rank joins one process group and all-reduces its rank.

Prints one JSON line per rank with what it saw, so tests (and people) can check the wiring:
RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR, the Slurm node, and the sum 0 + 1 + ... + (world - 1).
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from hpkit.runtime.env import distributed


def main() -> int:
    # What the launcher exported, read before joining: joining fills in whatever it left out.
    launched = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    with distributed() as job:
        rank, world = dist.get_rank(), dist.get_world_size()
        value = torch.tensor([float(rank)], device=job.device.torch_device())
        dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world,
        "env_rank": launched["RANK"],
        "env_local_rank": launched["LOCAL_RANK"],
        "env_world_size": launched["WORLD_SIZE"],
        "master_addr": launched["MASTER_ADDR"],
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "sum": value.item(),
        "expected": world * (world - 1) / 2,
    }
    # One write per record: ranks share the output file, and print() writes the newline separately.
    sys.stdout.write("allreduce " + json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0 if record["sum"] == record["expected"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
