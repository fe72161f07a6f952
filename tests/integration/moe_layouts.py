"""Runs one small mixture-of-experts model in several expert-parallel layouts and records what each did.

Launched by tests/integration/test_moe.py: as a plain process (the single-process reference), and under
torchrun with 2 and 4 processes. Rank 0 writes {layout: {"loss", "grad_norm", "aux_loss", "expert_load":
per-step lists, "experts": per global rank, the ep rank and, per MoE block it holds, a checksum of each
expert it holds at initialisation}} to the JSON file named on the command line.

The STARVED layouts add a bias to every router's logits that rules out the experts of the last ep rank (of
ep 2): that rank receives no token in any step, and its experts' backward must still meet its peers'
collectives (`GroupedExperts._compute`'s empty branch). Their records add "routed" per step: the routing
slots that went to the starved experts and to all experts. A rank still in them after
STARVED_TIMEOUT_S (left waiting in a collective) ends the run with its stacks instead of hanging it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import training_layouts
from training_layouts import BASE as DENSE

GLOBAL_BATCH = 8
STEPS = training_layouts.STEPS  # as there: a wrong exchange, reduction or placement shows by step 2
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


# The same model, but no token is ever routed to the experts of ep rank 1 of 2 (experts E/2 .. E-1).
STARVED: dict[int, dict[str, dict[str, Any]]] = {
    1: {"starved_reference": {"dp_shard": 1}},
    2: {"ep2_starved": {"dp_shard": 1, "ep": 2}},
}
STARVED_TIMEOUT_S = 30.0


def config_for(parallelism: dict[str, Any], world_size: int):
    from hpkit.runtime.config import RunConfig
    from hpkit.runtime.parallel.parallel_dims import ParallelDims
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


def starve_last_experts(trainer: Any) -> list[list[int]]:
    """Bias every router against experts E/2 .. E-1; returns the list each forward appends [slots that
    went to those experts, all slots] to (counted on this rank's tokens)."""
    import torch

    from hpkit.models.llama.moe import MoE

    routed: list[list[int]] = []
    bias = torch.zeros(EXPERTS)
    bias[EXPERTS // 2 :] = -1e4

    top_k = BASE["model"]["moe"]["top_k"]

    def biased(_router: Any, _inputs: Any, logits: Any) -> Any:
        logits = logits + bias.to(logits)
        chosen = logits.topk(top_k, dim=-1).indices
        routed.append([int((chosen >= EXPERTS // 2).sum()), chosen.numel()])
        return logits

    for part in trainer.model_parts:
        for moe in (m for m in part.modules() if isinstance(m, MoE)):
            moe.router.register_forward_hook(biased)
    return routed


def run_layouts(rank: int, world_size: int, device: Any, starved: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from hpkit.runtime.loop.trainer import Trainer

    results: dict[str, Any] = {}
    for name, parallelism in (STARVED if starved else LAYOUTS).get(world_size, {}).items():
        start = time.perf_counter()
        trainer = Trainer(config_for(parallelism, world_size), device)
        held: list[Any] = [None] * world_size
        dist.all_gather_object(held, experts_held(trainer))
        routed = starve_last_experts(trainer) if starved else None
        steps = [trainer.train_step() for _ in range(STEPS)]
        results[name] = {
            key: [getattr(s, key) for s in steps] for key in ("loss", "grad_norm", "aux_loss", "expert_load")
        } | {"experts": held}
        if routed is not None:
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, routed)
            results[name]["routed"] = everyone
        trainer.close()
        del trainer
        dist.barrier()
        if rank == 0:
            print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    return results


def main(out_path: str) -> int:
    import faulthandler

    from hpkit.runtime.env import distributed
    from hpkit.runtime.run import quiet_known_warnings

    quiet_known_warnings()
    with distributed() as job:
        rank, world_size = job.launch.rank, job.launch.world_size
        results = run_layouts(rank, world_size, job.device, starved=False)
        # A rank left waiting in a collective ends the run (stacks on stderr) instead of hanging it.
        faulthandler.dump_traceback_later(STARVED_TIMEOUT_S, exit=True)
        results |= run_layouts(rank, world_size, job.device, starved=True)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
