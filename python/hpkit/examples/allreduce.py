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


def main() -> int:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    value = torch.tensor([float(rank)], device=device)
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world,
        "env_rank": os.environ.get("RANK"),
        "env_local_rank": os.environ.get("LOCAL_RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "sum": value.item(),
        "expected": world * (world - 1) / 2,
    }
    # One write per record: ranks share the output file, and print() writes the newline separately.
    sys.stdout.write("allreduce " + json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if record["sum"] == record["expected"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
