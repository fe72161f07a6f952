"""Where the planner finds a model's shape (hpkit.models.llama.shape.ModelShape): a shape name, a spec's `model:`
block (a named shape with overrides, or `init_from`), or a Hugging Face config.json folder (Llama, Mixtral).

Each is read by the function the runtime reads it with (ModelSpec.named_shape, hpkit.models.llama.config_json's config.json
parser), so the planner and the trainer cannot disagree on a shape.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hpkit.errors import SpecError
from hpkit.models.families import SHAPE_NAMES, family_for
from hpkit.models.llama.config_json import CONFIG_NAME, load_config_json, parse_hf_config
from hpkit.models.llama.named import SHAPE_TABLE
from hpkit.models.llama.shape import ModelShape, shape_named

if TYPE_CHECKING:
    from hpkit.runtime.config import ModelSpec


def shape_of_spec(model: ModelSpec) -> ModelShape:
    """The shape a spec's `model:` block trains: the named shape with its overrides, or init_from's config.json."""
    if model.init_from:
        return with_lora(model, shape_from_hf(model.init_from, model.seq_len))
    family_for(model.name, model.moe is not None)  # the same lookup the trainer makes
    return with_lora(model, model.named_shape())


def with_lora(model: ModelSpec, shape: ModelShape) -> ModelShape:
    lora = getattr(model, "lora", None)
    if lora is None:
        return shape
    return replace(shape, lora_rank=lora.rank, lora_targets=tuple(lora.targets))


def shape_from_hf(directory: str | Path, seq_len: int) -> ModelShape:
    """DIR/config.json of a Llama or Mixtral checkpoint; SpecError naming the field for anything else."""
    data = load_config_json(directory, str, "name a Hugging Face model folder (with config.json)")
    return parse_hf_config(data, seq_len, str(Path(directory) / CONFIG_NAME)).shape


def resolve_model(model: str | Path, seq_len: int) -> ModelShape:
    """`hpkit plan MODEL`: a shape name, or a folder holding a Hugging Face config.json."""
    text = str(model)
    if text in SHAPE_TABLE:
        return shape_named(text, seq_len)
    if Path(text).is_dir():
        return shape_from_hf(text, seq_len)
    raise SpecError(
        f"model {text!r}: neither a shape name ({', '.join(SHAPE_NAMES)}) nor a folder with a Hugging Face "
        "config.json"
    )
