"""One rank of test_node_network.py's job: training_layouts' FSDP x TP layout, then where it rendezvoused.

After the run each rank prints `NET {...}`: its node, MASTER_ADDR, and the socket interfaces gloo and NCCL were
told to use (set by hpkit.runtime.env.init_distributed, unless the job set them).
"""

from __future__ import annotations

import json
import os
import sys

import training_layouts  # beside this file: a script's own folder is first on sys.path


def main(out_path: str) -> int:
    code = training_layouts.main(out_path, ["fsdp_tp"])
    record = {
        "rank": os.environ.get("RANK"),
        "node": os.environ.get("SLURMD_NODENAME"),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
    }
    print("NET " + json.dumps(record), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
