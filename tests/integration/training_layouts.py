"""Runs the same small model, data and seed in several parallel layouts and records losses and grad norms.

Launched by tests/integration/test_training_correctness.py: once as a plain process (the single-process
reference) and once under torchrun with 4 (and 2) processes, where every layout builds its own mesh in
turn. Rank 0 writes {layout: {"loss": [...], "grad_norm": [...], "stages": ...}} to the JSON file named on
the command line; "stages" is, per global rank, the pipeline stages that rank built (see `stages_held`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

GLOBAL_BATCH = 8
# Three steps: step 1 checks the forward and the reduced gradient norm, step 2 the first clipped AdamW update,
# step 3 one made with the optimizer's moments in place; a wrong reduction, clip or stage placement shows by step 2.
STEPS = 3

BASE: dict[str, Any] = {
    "name": "layouts",
    "model": {
        "name": "debug",
        "dim": 64,
        "n_layers": 4,
        "n_heads": 4,
        "ffn_dim": 128,
        "vocab_size": 256,
        "seq_len": 32,
    },
    "train": {
        "steps": STEPS,
        "lr": 3e-3,
        "weight_decay": 0.1,
        # Below the gradient norm on every step, so a wrong norm changes the update, not only the report.
        "grad_clip": 0.25,
        "mixed_precision": "fp32",
        "seed": 1234,
        "tensorboard": False,
    },
}

# name -> (parallelism block, train overrides). SageMaker-style keys are used where SMP users would.
LAYOUTS: dict[int, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    1: {"reference": ({"dp_shard": 1}, {})},
    4: {
        "ddp": ({"ddp": True}, {}),
        "fsdp": ({"dp_shard": 4}, {}),
        "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, {}),
        # On CPU tensor parallel keeps the residual stream whole unless sequence_parallel is set.
        "tp": ({"dp_shard": 1, "tensor_parallel_degree": 4}, {}),
        "fsdp_tp": ({"dp_shard": 2, "tp": 2}, {}),
        "fsdp_tp_sp": ({"dp_shard": 2, "tp": 2, "sequence_parallel": True}, {}),
        "ddp_tp": ({"ddp": True, "tensor_parallel_degree": 2}, {}),
        "fsdp_tp_chosen_modules": ({"dp_shard": 2, "tp": 2, "tp_modules": ["attention", "layers.3"]}, {}),
        "fsdp_ac_full": ({"dp_shard": 4}, {"activation_checkpoint": "full"}),
        "fsdp_tp_ac_selective": (
            {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
            {"activation_checkpoint": "selective"},
        ),
        "pp_fsdp_1f1b": ({"pp": 2, "dp_shard": 2, "microbatches": 4, "pp_schedule": "1f1b"}, {}),
        "pp_ddp_gpipe": (
            {"pipeline_parallel_degree": 2, "ddp": True, "microbatches": 4, "pp_schedule": "gpipe"},
            {},
        ),
        "pp_tp": ({"pp": 2, "dp_shard": 1, "tp": 2, "microbatches": 4}, {}),
        # Sequence-sharded activations cross the stage boundary.
        "pp_tp_sp": ({"pp": 2, "dp_shard": 1, "tp": 2, "microbatches": 4, "sequence_parallel": True}, {}),
        "pp4_1f1b": ({"pp": 4, "dp_shard": 1, "microbatches": 4}, {}),
        # Several stages per rank: FSDP and TP are applied to each part.
        "pp_fsdp_interleaved_1f1b": (
            {
                "pp": 2,
                "dp_shard": 2,
                "microbatches": 4,
                "pp_schedule": "interleaved_1f1b",
                "stages_per_rank": 2,
            },
            {},
        ),
        "pp_tp_zero_bubble": (
            {
                "pp": 2,
                "dp_shard": 1,
                "tp": 2,
                "microbatches": 4,
                "pp_schedule": "zero_bubble",
                "stages_per_rank": 2,
            },
            {},
        ),
    },
    2: {
        "pp_gpipe": ({"pp": 2, "dp_shard": 1, "microbatches": 4, "pp_schedule": "gpipe"}, {}),
        "pp_1f1b": ({"pp": 2, "dp_shard": 1, "microbatches": 4, "pp_schedule": "1f1b"}, {}),
        "pp_interleaved_1f1b": (
            {
                "pp": 2,
                "dp_shard": 1,
                "microbatches": 4,
                "pp_schedule": "interleaved_1f1b",
                "stages_per_rank": 2,
            },
            {},
        ),
        "pp_zero_bubble": (
            {"pp": 2, "dp_shard": 1, "microbatches": 4, "pp_schedule": "zero_bubble", "stages_per_rank": 2},
            {},
        ),
    },
}


def config_for(parallelism: dict[str, Any], train: dict[str, Any], world_size: int):
    from hpkit.runtime.config import RunConfig
    from hpkit.runtime.parallel.parallel_dims import ParallelDims
    from hpkit.validation import parse_document

    data = json.loads(json.dumps(BASE))
    data["parallelism"] = parallelism
    data["train"].update(train)
    cfg = parse_document(RunConfig, data)
    dims = ParallelDims.from_spec(cfg.parallelism, world_size)
    local = GLOBAL_BATCH // dims.dp
    return parse_document(RunConfig, {**data, "train": {**data["train"], "local_batch_size": local}})


def stages_held(trainer: Any) -> dict[str, Any]:
    """What this rank built: each part's stage index, blocks, and whether it has the embeddings or the
    head; and torch's own stage -> pp rank map where its schedule keeps one (multi-stage schedules)."""
    parts = [
        {
            "stage": stage,
            "layers": sorted(int(name) for name in part.layers),
            "embeddings": part.tok_embeddings is not None,
            "head": part.output is not None,
        }
        for stage, part in zip(trainer.pp_stages, trainer.model_parts, strict=True)
    ]
    torch_map = getattr(trainer.schedule, "stage_index_to_group_rank", None)
    return {
        "pp_rank": trainer.coords.pp_rank,
        "parts": parts,
        "torch_stage_to_rank": {str(k): v for k, v in torch_map.items()} if torch_map else None,
    }


def main(out_path: str, only: list[str] | None = None) -> int:
    import torch.distributed as dist

    from hpkit.runtime.env import distributed
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.runtime.run import quiet_known_warnings

    quiet_known_warnings()
    results: dict[str, Any] = {}
    with distributed() as job:
        rank, world_size = job.launch.rank, job.launch.world_size
        for name, (parallelism, train) in LAYOUTS[world_size].items():
            if only and name not in only:
                continue
            start = time.perf_counter()
            trainer = Trainer(config_for(parallelism, train, world_size), job.device)
            steps = [trainer.train_step() for _ in range(STEPS)]
            held: list[Any] = [None] * world_size
            dist.all_gather_object(held, stages_held(trainer))
            results[name] = {
                "loss": [s.loss for s in steps],
                "grad_norm": [s.grad_norm for s in steps],
                "seconds": time.perf_counter() - start,
                "stages": held,
            }
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
    sys.exit(main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else None))
