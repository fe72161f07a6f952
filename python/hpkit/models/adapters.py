"""Model families as plug-ins: one adapter each (hpkit.models.adapter), found by family or shape name.

A new family is a folder beside hpkit.models.llama (its shapes, model and adapter), a line in ADAPTERS and its
shape names in hpkit.models.families (the torch-free table that validates `model.name`).
"""

from __future__ import annotations

from torch import nn

from hpkit.models.adapter import ModelAdapter
from hpkit.models.families import FAMILIES, family_of
from hpkit.models.llama.adapter import LlamaAdapter
from hpkit.models.llama.moe_adapter import MoEAdapter

ADAPTERS: dict[str, ModelAdapter] = {adapter.family: adapter for adapter in (LlamaAdapter(), MoEAdapter())}


def adapter_for(name: str) -> ModelAdapter:
    """The adapter of a family, or of the family a shape name (`model.name`) belongs to."""
    family = name if name in FAMILIES else family_of(name)
    return ADAPTERS[family]


def adapter_of(model: nn.Module) -> ModelAdapter:
    """The adapter of a built model (whole, or a pipeline stage)."""
    for adapter in ADAPTERS.values():
        if adapter.owns(model):
            return adapter
    raise TypeError(f"{type(model).__name__} belongs to no model family: {', '.join(ADAPTERS)}")


__all__ = ["ADAPTERS", "ModelAdapter", "adapter_for", "adapter_of"]
