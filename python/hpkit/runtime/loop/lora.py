"""LoRA (low-rank adapters, as PEFT's): a frozen base whose chosen projections W gain `scaling * B @ A`.

`apply_lora` runs on a model part after tensor and expert parallel and before activation checkpointing,
compile and FSDP. Each targeted nn.Linear keeps its class's behaviour and its parameter names
(`attention.wq.weight`), gains two children `lora_A` (r x in) and `lora_B` (out x r), named as PEFT names
them, and has its class swapped for `LoRALinear`, whose forward adds the adapter's path. Why after tensor
parallel and by swapping the class: torch's Colwise/RowwiseParallel accept only an nn.Linear and shard
every parameter under it alike, while the adapter's two matrices need different placements; applied after
them, the module's input arrives already laid out by the tensor-parallel hooks and its output leaves
through them, so the adapter's path is written once with DTensor operations for every plan:

    base colwise (W Shard(0)):   A Replicate, B Shard(0)  -> B A x is sharded like W x (on the output dim)
    base rowwise (W Shard(1)):   A Shard(1),  B Replicate -> A x is a partial sum over the input shards,
                                 B A x too; it is added to W x's partial sum and reduced with it, once
    base replicated / no TP:     A and B whole

FSDP then shards A and B with the rest of each block and reduces only their gradients; the frozen base
never has a gradient, an optimizer state or a place in a checkpoint (ModelState's trainable_only).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hpkit.errors import SpecError
from hpkit.models.adapters import ModelAdapter
from hpkit.runtime.config import LORA_TARGETS, LoraSpec

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter: W x + scaling * B A dropout(x). Made by `apply_lora` from an
    existing (possibly tensor-parallel) nn.Linear, never constructed directly."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        delta = F.linear(F.linear(self.lora_dropout(x), self.lora_A.weight), self.lora_B.weight)
        return out + delta * self.scaling


def _adapter_placements(weight: torch.Tensor) -> tuple[list[Any], list[Any]] | None:
    """(A's placements, B's) matching a tensor-parallel base weight; None for a plain one."""
    if not isinstance(weight, DTensor):
        return None
    (placement,) = weight.placements  # the tp mesh is 1-D; FSDP comes later
    if placement == Shard(0):  # column-parallel: the output dimension is split
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):  # row-parallel: the input dimension is split
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


def _target_modules(part: nn.Module, adapter: ModelAdapter, spec: LoraSpec) -> list[tuple[str, nn.Linear]]:
    found = []
    for index, block in adapter.blocks(part).items():
        for target in spec.targets:
            path = LORA_TARGETS[target]
            try:
                module = block.get_submodule(path)
            except AttributeError:
                module = None
            if not isinstance(module, nn.Linear):
                raise SpecError(
                    f"model.lora.targets: {target} names no projection in block {index} of this "
                    f"{adapter.family} model (its feed-forward there is routed experts, which LoRA does not "
                    "adapt): target q_proj, k_proj, v_proj, o_proj only"
                )
            found.append((f"layers.{index}.{path}", module))
    return found


def apply_lora(
    part: nn.Module, spec: LoraSpec, adapter: ModelAdapter, mixed_precision: str, fsdp: bool
) -> int:
    """Freeze `part` and give its targeted projections adapters (still on the meta device: `init_lora`
    fills them once the part is materialised). Returns how many projections were adapted.

    Under bf16 the frozen base is stored in bf16, where that changes no number: with FSDP every
    parameter is cast to bf16 for the forward anyway; without it autocast casts only the matmuls'
    weights, so only the projections' weights are stored in bf16 (norms and embeddings keep fp32)."""
    for param in part.parameters():
        param.requires_grad_(False)
    if mixed_precision == "bf16":
        for module in part.modules():
            if fsdp or isinstance(module, nn.Linear):
                _cast_params(module, torch.bfloat16)
    targets = _target_modules(part, adapter, spec)
    for _, module in targets:
        placements = _adapter_placements(module.weight)
        device = module.weight.device
        a = nn.Linear(module.in_features, spec.rank, bias=False, device=device)
        b = nn.Linear(spec.rank, module.out_features, bias=False, device=device)
        if placements is not None:
            mesh = module.weight.device_mesh
            for layer, where in zip((a, b), placements, strict=True):
                sharded = distribute_tensor(layer.weight, mesh, where, src_data_rank=None)
                layer.register_parameter("weight", nn.Parameter(sharded))
        module.lora_A, module.lora_B = a, b
        module.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        module.scaling = spec.scaling
        module.__class__ = LoRALinear
    return len(targets)


def _cast_params(module: nn.Module, dtype: torch.dtype) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        if param.dtype != dtype:
            module.register_parameter(name, nn.Parameter(param.to(dtype), requires_grad=False))


def adapter_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(clean name, parameter) of every adapter matrix, as init and export name them."""
    found = []
    for name, param in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if clean.endswith(ADAPTER_SUFFIXES):
            found.append((clean, param))
    return found


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation: A kaiming-uniform (a=sqrt(5): bound 1/sqrt(in)), B zeros, so that training
    starts from the base model exactly. Drawn whole from (seed, name) and sliced, as the base is: the same
    values in every layout."""
    for name, param in adapter_parameters(model):
        device = param.to_local().device if isinstance(param, DTensor) else param.device
        if name.endswith(".lora_B.weight"):
            full = torch.zeros(param.shape, device=device)
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            bound = 1 / math.sqrt(param.shape[1])
            full = torch.empty(param.shape, device=device).uniform_(-bound, bound, generator=gen)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


# ----------------------------------------------------------------------------------------------------
# The base's identity: a checkpoint of adapters is only meaningful on the base it was trained on.

_SAMPLE = 1 << 20


def base_identity(init_from: str | None, model_config: dict[str, Any], seed: int) -> dict[str, str]:
    """{"source", "sha256"} of the frozen base. From a Hugging Face directory: its config.json, and per
    safetensors file its name, size, header (names, shapes, dtypes, offsets) and the CRC-32C of its first
    and last MiB of data (two fine-tunes of one architecture differ there; reading every byte of a 70B
    model at each start would not be worth it). From a seeded init: the shape and the seed."""
    digest = hashlib.sha256()
    if init_from is None:
        digest.update(json.dumps({"config": model_config, "seed": seed}, sort_keys=True).encode())
        return {"source": f"seed {seed}", "sha256": digest.hexdigest()}
    root = Path(init_from)
    try:
        digest.update((root / "config.json").read_bytes())
        for file in sorted(root.glob("*.safetensors")):
            size = file.stat().st_size
            with file.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = f.read(header_len)
                head = f.read(_SAMPLE)
                f.seek(max(8 + header_len, size - _SAMPLE))
                tail = f.read(_SAMPLE)
            digest.update(f"{file.name}\0{size}\0".encode() + header)
            digest.update(f"{crc32c.crc32c(head):08x}{crc32c.crc32c(tail):08x}".encode())
    except OSError as exc:
        raise SpecError(f"model.init_from: {init_from}: cannot read the base: {exc}") from None
    return {"source": str(root), "sha256": digest.hexdigest()}


def lora_record(spec: LoraSpec, base: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint's commit record keeps of the adapters (model.lora): enough to export them and to
    refuse a resume on another base."""
    return {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "targets": list(spec.targets),
        "base": base,
    }


def resume_refusal(theirs: dict[str, Any] | None, mine: dict[str, Any] | None, where: str) -> str | None:
    """Why this run must not resume checkpoint `where` (recorded `theirs`, this run's `mine`), or None."""
    if theirs is None and mine is None:
        return None
    if mine is None:
        return (
            f"{where} holds LoRA adapters, not a model; this run trains every weight: set model.lora as it "
            "was, or give a new checkpoint.dir"
        )
    if theirs is None:
        return (
            f"{where} holds a whole model; this run (model.lora) trains adapters: give a new "
            "checkpoint.dir, or remove model.lora"
        )
    if theirs["base"]["sha256"] != mine["base"]["sha256"]:
        return (
            f"{where} trained adapters on the base {theirs['base']['source']} "
            f"(sha256 {theirs['base']['sha256'][:12]}), this run's base is {mine['base']['source']} "
            f"(sha256 {mine['base']['sha256'][:12]}): point model.init_from at the base it was trained on, "
            "or give a new checkpoint.dir"
        )
    for key in ("rank", "targets"):
        if theirs.get(key) != mine.get(key):
            return (
                f"{where} holds adapters with {key} {theirs.get(key)}, this run asks for {mine.get(key)}: "
                f"set model.lora.{key} as it was, or give a new checkpoint.dir"
            )
    return None
