"""Model families are plug-ins: the runtime finds a family's adapter by name and asks it about the model."""

from __future__ import annotations

import pytest
import torch

from hpkit.models.adapters import ADAPTERS, adapter_for, adapter_of
from hpkit.models.families import FAMILIES, SHAPE_NAMES, family_of
from hpkit.runtime.config import ModelSpec
from hpkit.validation import parse_document


def test_every_family_has_an_adapter_that_builds_each_of_its_shapes():
    assert set(FAMILIES) == set(ADAPTERS)
    for family, names in FAMILIES.items():
        for name in names:
            cfg = adapter_for(name).config(ModelSpec(name=name).named_shape())
            assert adapter_for(name) is ADAPTERS[family]
            assert (cfg.moe is not None) == (family == "moe"), name


def test_each_family_is_one_folder_its_adapter_model_and_hugging_face_names_share():
    """A family's adapter, the model it builds, its Hugging Face tensor names and its torch-free shape all come
    from one folder, hpkit.models.<folder>: adding a family is a folder, not edits across the runtime."""
    for family, names in FAMILIES.items():
        adapter = ADAPTERS[family]
        folder = type(adapter).__module__.rpartition(".")[0]
        assert folder.startswith("hpkit.models.") and folder != "hpkit.models", (family, folder)
        shape = ModelSpec(name=names[0]).named_shape()
        model = adapter.build(adapter.config(shape), "meta")
        homes = {
            "model": type(model).__module__,
            "shape": type(shape).__module__,
            "hf tensor names": adapter.hf.tensor_name.__module__ if adapter.hf else folder,
            "config.json": adapter.hf.read_config.__module__ if adapter.hf else folder,
        }
        assert all(home.startswith(folder + ".") for home in homes.values()), (family, folder, homes)


def test_a_shape_name_finds_its_family_and_an_unknown_one_is_refused():
    assert adapter_for("debug") is adapter_for("llama") is ADAPTERS["llama"]
    assert family_of("8B") == "llama"
    with pytest.raises(KeyError, match="choose one of debug"):
        family_of("13B")
    assert SHAPE_NAMES[0] == "debug"


def test_model_name_is_validated_against_the_table():
    from hpkit.errors import SpecError

    with pytest.raises(SpecError, match=r"name: Input should be 'debug', .*'70B'"):
        parse_document(ModelSpec, {"name": "13B"})


def test_the_llama_adapter_describes_its_model():
    adapter = adapter_for("debug")
    cfg = adapter.config(
        ModelSpec(name="debug", dim=32, n_layers=3, n_heads=4, ffn_dim=64, vocab_size=50).named_shape()
    )
    model = adapter.build(cfg, "meta")
    assert adapter_of(model) is adapter
    assert list(adapter.blocks(model)) == ["0", "1", "2"]
    assert adapter.input_units(model) == [model.tok_embeddings]
    assert adapter.output_units(model) == [model.norm, model.output]
    assert adapter.expert_modules(model) == []
    assert adapter.flops_per_token(cfg, 16) == cfg.flops_per_token(16)
    assert adapter.config_from_dict(adapter.config_to_dict(cfg)) == cfg
    middle = adapter.keep_stage(adapter.build(cfg, "meta"), [1], first=False, last=False)
    assert list(adapter.blocks(middle)) == ["1"] and adapter.input_units(middle) == []
    assert adapter.output_units(middle) == []
    with pytest.raises(TypeError, match="no model family"):
        adapter_of(torch.nn.Linear(2, 2))
