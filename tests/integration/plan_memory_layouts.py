"""Trains a small model in each layout the runtime runs and measures every rank's peak memory with torch's MemTracker.

Launched by tests/integration/test_plan_memory_measured.py under torchrun with 4 processes (one launch for
every layout: each builds its own mesh in turn), or as a plain process for the single-process layout.
Rank 0 writes {layout: {"spec": the run config's JSON, "ranks": per global rank {"pp_rank", "peak": the
tracker's peak snapshot by category, in bytes}}} to the JSON file named on the command line.

The model is small but not trivial: the parts that scale (weights, activations, logits) are large beside
the constant ones (rotary tables, the loader's batch, the step's scalars), so a wrong formula shows.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

STEPS = 2  # the optimizer's state appears in step 1's update; step 2 runs with it in place

MODEL: dict[str, Any] = {
    "name": "debug",
    "dim": 128,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 384,
    "vocab_size": 1024,
    "seq_len": 64,
}
LORA = {"rank": 8}
MOE = {"experts": 4, "top_k": 2, "shared_experts": 1, "every": 1, "aux_loss_coef": 0.01}

# name -> (model overrides, parallelism, train overrides). Local batch: 8 sequences per data-parallel rank.
LAYOUTS: dict[int, dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]] = {
    1: {
        "single": ({}, {"dp_shard": 1}, {}),
        "single_bf16": ({}, {"dp_shard": 1}, {"mixed_precision": "bf16"}),
        # LoRA: a frozen base (bf16 projections under autocast), adapters the only trainable weights.
        "single_lora_bf16": ({"lora": LORA}, {"dp_shard": 1}, {"mixed_precision": "bf16"}),
    },
    4: {
        "fsdp": ({}, {"dp_shard": 4}, {}),
        "fsdp_ac_full": ({}, {"dp_shard": 4}, {"activation_checkpoint": "full"}),
        "fsdp_ac_selective": ({}, {"dp_shard": 4}, {"activation_checkpoint": "selective"}),
        "hsdp": ({}, {"dp_replicate": 2, "dp_shard": 2}, {}),
        "fsdp_tp": ({}, {"dp_shard": 2, "tp": 2}, {}),
        "fsdp_tp_sp_ac_selective": (
            {},
            {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
            {"activation_checkpoint": "selective"},
        ),
        "hsdp_tp": ({}, {"dp_replicate": 2, "dp_shard": 1, "tp": 2}, {}),
        "pp_tp_gpipe": ({}, {"pp": 2, "dp_shard": 1, "tp": 2, "microbatches": 4, "pp_schedule": "gpipe"}, {}),
        "pp_tp_1f1b": ({}, {"pp": 2, "dp_shard": 1, "tp": 2, "microbatches": 4}, {}),
        "pp_tp_interleaved": (
            {},
            {
                "pp": 2,
                "dp_shard": 1,
                "tp": 2,
                "microbatches": 4,
                "pp_schedule": "interleaved_1f1b",
                "stages_per_rank": 2,
            },
            {},
        ),
        "pp_tp_zero_bubble": (
            {},
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
        "pp_fsdp_1f1b_ac_full": (
            {},
            {"pp": 2, "dp_shard": 2, "microbatches": 4},
            {"activation_checkpoint": "full"},
        ),
        "pp4_1f1b": ({}, {"pp": 4, "dp_shard": 1, "microbatches": 4}, {}),
        "fsdp_tp_lora": ({"lora": LORA}, {"dp_shard": 2, "tp": 2}, {}),
        "ep2_fsdp2": ({"moe": MOE}, {"dp_shard": 2, "ep": 2}, {}),
        "ep2_fsdp2_ac_full": ({"moe": MOE}, {"dp_shard": 2, "ep": 2}, {"activation_checkpoint": "full"}),
        "ep2_tp2": ({"moe": MOE}, {"dp_shard": 1, "ep": 2, "tp": 2}, {}),
        "pp2_ep2": ({"moe": MOE}, {"pp": 2, "dp_shard": 1, "ep": 2, "microbatches": 4}, {}),
    },
}
LOCAL_BATCH = 8


def spec_for(model: dict[str, Any], parallelism: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "plan-memory",
        "model": {**MODEL, **model},
        "parallelism": parallelism,
        "train": {
            "steps": STEPS,
            "local_batch_size": LOCAL_BATCH,
            "mixed_precision": "fp32",
            "tensorboard": False,
            "stragglers": {"enabled": False},
            **train,
        },
    }


def measure(trainer: Any) -> dict[str, int]:
    """The peak of every tensor the steps hold (weights, gradients, optimizer state included), by category."""
    tracker = _without_module_hooks()
    tracker.track_external(*trainer.model_parts, *trainer.optimizers)
    with tracker:
        for _ in range(STEPS):
            trainer.train_step()
    peak = tracker.get_tracker_snapshot("peak")
    (by_kind,) = peak.values()  # one device: the CPU
    return {str(k): int(v) for k, v in by_kind.items()}


def _without_module_hooks() -> Any:
    """MemTracker without its per-module hooks, in every layout. It still sees every allocation (its dispatch
    mode), so the peak Total is the same: on all 21 layouts' ranks, with and without the hooks, to the byte
    (checked when this replaced the hooked tracker, issue 46). The hooks only relabel categories (the
    forward/backward split, unsharded FSDP weights as parameters: without them everything made in the step
    counts as activations), and they cost: the hooked layouts' steps ran 2-3x slower. They also break
    pipelines (a stage's backward runs autograd.grad, torch 2.13) and hook every parameter's gradient
    (a frozen LoRA base has none)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tracker(MemTracker):
        def __enter__(self) -> Any:
            self._fake_mode_on_entry = None
            self._register_global_optimizer_hook()
            self._track_resize()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args: Any) -> None:
            self._deregister_param_and_optimizer_hooks()
            self._restore_resize()
            TorchDispatchMode.__exit__(self, *args)

    return Tracker()


def main(out_path: str, only: list[str] | None = None) -> int:
    import torch.distributed as dist

    from hpkit.runtime.config import RunConfig
    from hpkit.runtime.env import distributed
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.runtime.run import quiet_known_warnings
    from hpkit.validation import parse_document

    quiet_known_warnings()
    results: dict[str, Any] = {}
    with distributed() as job:
        rank, world_size = job.launch.rank, job.launch.world_size
        for name, (model, parallelism, train) in LAYOUTS[world_size].items():
            if only and name not in only:
                continue
            start = time.perf_counter()
            spec = spec_for(model, parallelism, train)
            trainer = Trainer(parse_document(RunConfig, spec), job.device)
            peak = measure(trainer)
            held: list[Any] = [None] * world_size
            dist.all_gather_object(held, {"pp_rank": trainer.coords.pp_rank, "peak": peak})
            results[name] = {"spec": spec, "world": world_size, "ranks": held}
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
