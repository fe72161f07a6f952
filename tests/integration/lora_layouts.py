"""Trains LoRA adapters on a tiny Hugging Face Llama (model.init_from) in several layouts and records what to
compare. Launched by tests/integration/test_lora.py: once as a plain process and once under torchrun with 4
processes, where every layout builds its own mesh in turn.

Per layout: the losses, a digest of every frozen base weight (whole tensors) before and after training, which
adapter matrices had a non-zero gradient on the last step, and the names of what the optimizers hold.
The single process also saves a checkpoint and the logits of the trained model on fixed tokens (the export
test compares peft's with them), resumes from it, refuses to resume it against another base, and saves a
LoRA checkpoint of the 125M shape (its bytes against a whole checkpoint's).

Usage: lora_layouts.py HF_DIR OTHER_HF_DIR OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpkit.runtime.checkpoints.checkpoint import Checkpointer, CheckpointError
from hpkit.runtime.checkpoints.checkpoint_record import read_record
from hpkit.runtime.config import CheckpointSpec, RunConfig
from hpkit.runtime.env import distributed
from hpkit.runtime.loop.lora import ADAPTER_SUFFIXES
from hpkit.runtime.loop.trainer import Trainer
from hpkit.runtime.run import quiet_known_warnings
from hpkit.validation import parse_document

SEQ = 32
GLOBAL_BATCH = 4
STEPS = 4
LORA = {
    "rank": 4,
    "alpha": 8,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    1: {"single": {"dp_shard": 1}},
    4: {
        "dp2_tp2": {"dp_shard": 2, "tp": 2},
        "pp2_dp2": {"pp": 2, "dp_shard": 2, "microbatches": 2},
        # bf16 under FSDP: the frozen base is stored in bf16 (FSDP casts it so for the forward anyway).
        "fsdp4_bf16": {"dp_shard": 4},
    },
}
TOKENS = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))


def config(
    init_from: str, parallelism: dict[str, Any], dp: int, precision: str = "fp32", **model: Any
) -> RunConfig:
    return parse_document(
        RunConfig,
        {
            "name": "lora-layouts",
            "parallelism": parallelism,
            "model": {
                "seq_len": SEQ,
                "lora": LORA,
                **({"init_from": init_from} if init_from else {}),
                **model,
            },
            "train": {
                "steps": STEPS,
                "local_batch_size": GLOBAL_BATCH // dp,
                # High enough that the adapters move the loss visibly within a few steps.
                "lr": 1e-2,
                "grad_clip": 1.0,
                "mixed_precision": precision,
                "seed": 11,
                "tensorboard": False,
                "stragglers": {"enabled": False},
            },
        },
    )


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _whole(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def base_digests(trainer: Trainer) -> dict[str, str]:
    """sha256 of every frozen weight, whole (gathered), keyed by name; merged over all ranks."""
    mine = {}
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            if not param.requires_grad:
                mine[name] = hashlib.sha256(_bytes(_whole(param))).hexdigest()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[str, str] = {}
    for part in gathered:
        merged.update(part)
    return merged


def watch_adapter_grads(trainer: Trainer) -> dict[str, bool]:
    """Before each optimizer step, note per adapter matrix whether this rank's gradient has a non-zero entry."""
    seen: dict[str, bool] = {}
    for part, optimizer in zip(trainer.model_parts, trainer.optimizers, strict=True):
        names = {id(p): n for n, p in part.named_parameters()}

        def hook(opt: Any, _args: Any, _kwargs: Any, names: dict[int, str] = names) -> None:
            for group in opt.param_groups:
                for p in group["params"]:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    seen[names[id(p)]] = bool(g is not None and g.abs().sum() > 0)

        optimizer.register_step_pre_hook(hook)
    return seen


def train_layout(
    init_from: str, parallelism: dict[str, Any], device: Any, precision: str
) -> tuple[Trainer, dict[str, Any]]:
    world = dist.get_world_size()
    probe = config(init_from, parallelism, 1)
    from hpkit.runtime.parallel.parallel_dims import ParallelDims

    dp = ParallelDims.from_spec(probe.parallelism, world).dp
    trainer = Trainer(config(init_from, parallelism, dp, precision), device)
    trainer.load_pretrained()
    before = base_digests(trainer)
    grads = watch_adapter_grads(trainer)
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    after = base_digests(trainer)
    gathered: list[Any] = [None] * world
    held = sorted({n for part in trainer.model_parts for n, p in part.named_parameters() if p.requires_grad})
    in_optimizer = sorted(
        {
            n
            for part, opt in zip(trainer.model_parts, trainer.optimizers, strict=True)
            for n, p in part.named_parameters()
            if any(p is q for g in opt.param_groups for q in g["params"])
        }
    )
    dist.all_gather_object(gathered, (grads, held, in_optimizer))
    nonzero: dict[str, bool] = {}
    optimizer_names: set[str] = set()
    for rank_grads, _held, rank_opt in gathered:
        for name, flag in rank_grads.items():
            nonzero[name] = nonzero.get(name, False) or flag
        optimizer_names.update(rank_opt)
    return trainer, {
        "loss": losses,
        "base_before": before,
        "base_after": after,
        "adapter_grad_nonzero": nonzero,
        "optimizer_params": sorted(optimizer_names),
        "frozen_dtypes": sorted(
            {str(p.dtype) for part in trainer.model_parts for p in part.parameters() if not p.requires_grad}
        ),
    }


def single_process_extras(
    trainer: Trainer, hf_dir: str, other_hf: str, out: Path, device: Any
) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    with torch.no_grad():
        torch.save(trainer.module(TOKENS).float(), out / "logits.pt")
    root = out / "ckpt"
    spec = CheckpointSpec(dir=str(root))
    ckpt = Checkpointer(spec, root, 0, model=trainer.model_record(), refusal=trainer.checkpoint_refusal)
    ckpt.save(trainer.step, trainer.checkpoint_state(), final=True)
    ckpt.close()
    adapters = {
        n: _whole(p).clone()
        for n, p in trainer.model_parts[0].named_parameters()
        if n.endswith(ADAPTER_SUFFIXES)
    }
    # The same base resumes: the adapters and the step come back.
    again = Trainer(config(hf_dir, {"dp_shard": 1}, 1), device)
    ck = Checkpointer(spec, root, 0, model=again.model_record(), refusal=again.checkpoint_refusal)
    extras["resumed_from"] = str(again.resume(ck))
    extras["resumed_step"] = again.step
    extras["resumed_adapters_equal"] = all(
        torch.equal(_whole(p), adapters[n])
        for n, p in again.model_parts[0].named_parameters()
        if n in adapters
    )
    ck.close()
    again.close()
    # Another base is refused before anything is loaded.
    other = Trainer(config(other_hf, {"dp_shard": 1}, 1), device)
    ck = Checkpointer(spec, root, 0, model=other.model_record(), refusal=other.checkpoint_refusal)
    try:
        other.resume(ck)
        extras["other_base"] = None
    except CheckpointError as exc:
        extras["other_base"] = str(exc)
    ck.close()
    other.close()
    # The 125M shape: one step, one LoRA checkpoint.
    big = Trainer(config("", {"dp_shard": 1}, GLOBAL_BATCH, name="125M"), device)
    big.train_step()
    big_root = out / "ckpt-125M"
    ck = Checkpointer(spec, big_root, 0, model=big.model_record(), refusal=big.checkpoint_refusal)
    ck.save(1, big.checkpoint_state(), final=True)
    ck.close()
    extras["125M_lora_bytes"] = read_record(big_root / "step-00000001").total_bytes
    extras["125M_params"] = sum(p.numel() for p in big.model_parts[0].parameters())
    extras["125M_trainable"] = sum(p.numel() for p in big.model_parts[0].parameters() if p.requires_grad)
    big.close()
    return extras


def main() -> int:
    hf_dir, other_hf, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    quiet_known_warnings()
    results: dict[str, Any] = {}
    with distributed() as job:
        world = job.launch.world_size
        for name, parallelism in LAYOUTS[world].items():
            start = time.perf_counter()
            precision = "bf16" if name.endswith("_bf16") else "fp32"
            trainer, results[name] = train_layout(hf_dir, parallelism, job.device, precision)
            if world == 1:
                results[name]["extras"] = single_process_extras(trainer, hf_dir, other_hf, out, job.device)
            trainer.close()
            del trainer
            dist.barrier()
            if job.launch.rank == 0:
                print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
        if job.launch.rank == 0:
            (out / f"layouts-{world}.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
