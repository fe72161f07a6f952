"""The model families `hpkit train` can build and the shape names each answers to: `model.name` is one of them.

Torch-free, so that a login node validates a spec without importing a model. The runtime finds a family's
adapter (how to build, split, parallelise and convert that family: `hpkit.runtime.adapters`) by the family
named here; tests/unit/test_model_adapters.py keeps this table equal to the adapters' own shape tables.
"""

from __future__ import annotations

# family -> shape names, in the order they are listed to users.
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("debug", "125M", "1B", "8B", "70B"),
    # Llama blocks whose FFNs are mixtures of experts (hpkit.models.moe); model.moe on any shape makes one.
    "moe": ("debug-moe",),
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
