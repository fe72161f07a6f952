"""torch.compile per block (after TP and activation checkpointing, before FSDP), and the guard that
refuses compile with tensor parallel where it is known to be wrong."""

from __future__ import annotations

import os

import torch
from torch import nn

from hpkit.errors import SpecError
from hpkit.models.adapters import ModelAdapter, adapter_of

# Measured with torch 2.13.0 on CPU: compile + TP crashes in backward (1-D TP) or silently gives
# wrong gradients (FSDP x TP). The override is for a device where tests/integration proves it right.
ALLOW_COMPILE_TP_ENV = "HPKIT_ALLOW_COMPILE_WITH_TP"


def check_compile_allowed(compile_: bool, tp_enabled: bool, device_type: str) -> None:
    if not (compile_ and tp_enabled):
        return
    if os.environ.get(ALLOW_COMPILE_TP_ENV) == "1":
        return
    raise SpecError(
        f"train.compile with tensor parallel (tp>1) is refused: with torch {torch.__version__} on {device_type} "
        "it crashes in backward or produces wrong gradients without an error. Set compile: false, or tp: 1; "
        f"if tests/integration/test_training_correctness.py passes with compile on this device, export "
        f"{ALLOW_COMPILE_TP_ENV}=1 to allow it"
    )


def apply_compile(model: nn.Module, adapter: ModelAdapter | None = None) -> None:
    # Per block rather than the whole model: graphs stay small, and FSDP's hooks run between them.
    blocks = (adapter or adapter_of(model)).blocks(model)
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, torch.compile(block))
