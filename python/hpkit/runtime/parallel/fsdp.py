"""Data parallel: FSDP2 (fully_shard per block, then the root), HSDP over (dp_replicate, dp_shard), or DDP.

Applied last, after TP, activation checkpointing and compile, so each FSDP unit is one finished block.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hpkit.models.adapters import ModelAdapter, adapter_of

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    # Compute in bf16 but reduce gradients in fp32: summing many bf16 shards loses too many bits.
    return MixedPrecisionPolicy(param_dtype=_DTYPES[mixed_precision], reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mixed_precision: str,
    pp_enabled: bool,
    adapter: ModelAdapter | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 over `dp_mesh`, one unit per block plus the embeddings and the head. Under expert parallel
    the routed experts are units of their own over `expert_mesh` (the data-parallel ranks that hold the
    same experts), since they are already split over the ep ranks that `dp_mesh` also spans."""
    adapter = adapter or adapter_of(model)
    mp = mixed_precision_policy(mixed_precision)
    # Under PP every microbatch runs forward and backward separately: resharding after each forward
    # would all-gather the stage's weights once per microbatch.
    reshard = not pp_enabled
    # The embeddings and the head are units of their own rather than left to the root: the root's
    # gradients are reduced only after the whole backward, where nothing overlaps them, while the
    # head's (half of a small model's parameters with a large vocabulary) are then reduced as soon as
    # its backward is done, under the blocks' backward.
    inputs = adapter.input_units(model)
    if inputs:
        fully_shard(
            inputs if len(inputs) > 1 else inputs[0],
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=reshard,
        )
    blocks = list(adapter.blocks(model).values())
    for i, block in enumerate(blocks):
        if expert_mesh is not None:
            for experts in adapter.expert_modules(block):
                fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
        # The last block's weights are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and i < len(blocks) - 1)
    head = adapter.output_units(model)
    if head:
        # Backward starts with the head, right after its forward: keep it gathered.
        fully_shard(head, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device] if device.type == "cuda" else None,
        broadcast_buffers=False,
        # Parameters arrive identical on every rank (same seeded init), so no initial broadcast is needed,
        # but DDP's check is cheap and catches a broken init.
    )
