"""What each rank of a SageMaker test script reports: a digest of its weights before and after training.

Not part of the seeds: the scripts call it once at the start and once at the end, and each rank writes
one JSON file that the test compares across ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def report(out_dir: str, rank: int, **record: object) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME"), **record}
    (Path(out_dir) / f"weights-rank{rank}.json").write_text(json.dumps(record, sort_keys=True))
