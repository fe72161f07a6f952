"""Runs one small mixture-of-experts model in several expert-parallel layouts and records what each did.

Launched by tests/integration/test_moe.py: as a plain process (the single-process reference), and under
torchrun with 2 and 4 processes. Rank 0 writes {layout: {"loss", "grad_norm", "aux_loss", "expert_load":
per-step lists, "experts": per global rank, the ep rank and, per MoE block it holds, a checksum of each
expert it holds at initialisation}} to the JSON file named on the command line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from training_layouts import BASE as DENSE

GLOBAL_BATCH = 8
STEPS = 5
EXPERTS = 4

BASE: dict[str, Any] = {
    **DENSE,
    "name": "moe-layouts",
    "model": {
        **DENSE["model"],
        # every 1: each block's FFN is a MoE, so every pipeline stage and every block exchanges tokens.
        "moe": {"experts": EXPERTS, "top_k": 2, "shared_experts": 1, "every": 1, "aux_loss_coef": 0.1},
    },
}

LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    1: {"reference": {"dp_shard": 1}},
    2: {"ep2": {"dp_shard": 1, "ep": 2}},
    4: {
        "ep2_fsdp2": {"dp_shard": 2, "ep": 2},
        "ep2_tp2": {"dp_shard": 1, "ep": 2, "tp": 2},
        "pp2_ep2": {"pp": 2, "dp_shard": 1, "ep": 2, "microbatches": 4},
    },
}


def config_for(parallelism: dict[str, Any], world_size: int):
    from hpkit.runtime.config import RunConfig
    from hpkit.runtime.parallel_dims import ParallelDims
    from hpkit.validation import parse_document

    data = json.loads(json.dumps(BASE))
    data["parallelism"] = parallelism
    dims = ParallelDims.from_spec(parse_document(RunConfig, data).parallelism, world_size)
    data["train"]["local_batch_size"] = GLOBAL_BATCH // dims.dp
    return parse_document(RunConfig, data)


def experts_held(trainer: Any) -> dict[str, Any]:
    """This rank's ep rank and, per MoE block it holds, the sum of each of its experts' w1 (unsharded
    from FSDP first: the experts an ep rank holds, not the FSDP slice of them)."""
    from torch.distributed.fsdp import FSDPModule

    held: dict[str, list[float]] = {}
    for part in trainer.model_parts:
        for name, block in trainer.adapter.blocks(part).items():
            for experts in trainer.adapter.expert_modules(block):
                if isinstance(experts, FSDPModule):
                    experts.unshard()
                w1 = experts.w1
                local = w1.to_local() if hasattr(w1, "to_local") else w1
                held[name] = [float(local[e].double().sum()) for e in range(local.shape[0])]
                if isinstance(experts, FSDPModule):
                    experts.reshard()
    return {"ep_rank": trainer.coords.local_rank_in("ep"), "blocks": held}


def main(out_path: str) -> int:
    import torch.distributed as dist

    from hpkit.runtime.env import distributed
    from hpkit.runtime.run import quiet_known_warnings
    from hpkit.runtime.trainer import Trainer

    quiet_known_warnings()
    results: dict[str, Any] = {}
    with distributed() as job:
        rank, world_size = job.launch.rank, job.launch.world_size
        for name, parallelism in LAYOUTS[world_size].items():
            start = time.perf_counter()
            trainer = Trainer(config_for(parallelism, world_size), job.device)
            held: list[Any] = [None] * world_size
            dist.all_gather_object(held, experts_held(trainer))
            steps = [trainer.train_step() for _ in range(STEPS)]
            results[name] = {
                key: [getattr(s, key) for s in steps]
                for key in ("loss", "grad_norm", "aux_loss", "expert_load")
            } | {"experts": held}
            trainer.close()
            del trainer
            dist.barrier()
            if rank == 0:
                print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
