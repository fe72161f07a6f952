"""Activation checkpointing per block: full (recompute the whole block) or selective (keep matmul outputs).

Applied after tensor parallel and before compile and FSDP, so the wrapper sees the parallelised block
and FSDP's per-block units wrap the checkpointed block.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hpkit.models.adapters import ModelAdapter, adapter_of

# The expensive ops whose outputs are worth their memory; everything else (norms, activations,
# rotary math) is cheap to recompute.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, adapter: ModelAdapter | None = None) -> None:
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint={mode!r}: use none, full or selective")
    blocks = (adapter or adapter_of(model)).blocks(model)
    for name, block in list(blocks.named_children()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block,
                preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _policy),
            )
        blocks.register_module(name, wrapped)
