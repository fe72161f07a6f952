"""The model families `hpkit train` can build and the shape names each answers to: `model.name` is one of them.

Torch-free, so that a login node validates a spec without importing a model. The runtime finds a family's
adapter (how to build, split, parallelise and convert that family: `hpkit.models.adapters`) by the family
named here. A family's shape names come from its folder's table (hpkit.models.llama.named for both Llama
families: a shape with a `moe` block is a mixture of experts).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpkit.models.llama.config_json import CONFIG_NAME, HF_FAMILIES
from hpkit.models.llama.named import SHAPE_TABLE

# family -> shape names, in the order they are listed to users.
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": tuple(name for name, fields in SHAPE_TABLE.items() if "moe" not in fields),
    # Llama blocks whose FFNs are mixtures of experts (hpkit.models.llama.moe); model.moe on any shape makes one.
    "moe": tuple(name for name, fields in SHAPE_TABLE.items() if "moe" in fields),
}

SHAPE_NAMES: tuple[str, ...] = tuple(name for names in FAMILIES.values() for name in names)


def family_of(shape: str) -> str:
    """The family a shape name belongs to; KeyError for a name no family has."""
    for family, names in FAMILIES.items():
        if shape in names:
            return family
    raise KeyError(f"unknown model {shape!r}: choose one of {', '.join(SHAPE_NAMES)}")


def family_for(shape: str, moe: bool) -> str:
    """The family that builds `model.name` = shape, `moe` when the spec sets model.moe."""
    return "moe" if moe else family_of(shape)


def hf_family(directory: str | Path) -> str:
    """The model family of DIR/config.json's model_type ("llama" when it cannot be read: reading the config
    then names the problem)."""
    try:
        model_type = json.loads((Path(directory) / CONFIG_NAME).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return "llama"
    return HF_FAMILIES.get(model_type, "llama")
