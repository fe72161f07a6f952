"""Hugging Face Llama weights in: a tiny random LlamaForCausalLM that transformers builds and saves here
(no download) loads through model.init_from, and hpkit's logits equal transformers' on one process.

transformers is the implementation no one here wrote: rotary layout, GQA, Llama 3 rope scaling and tied
embeddings are each checked against it, not against hpkit's own idea of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

from hpkit.errors import SpecError
from hpkit.hf.load import INDEX_NAME, load_hf_weights, to_hf_rows, to_runtime_rows
from hpkit.models.llama.hf_format import parse_hf_config, read_hf_config
from hpkit.models.llama.model import SHAPES, build_model
from hpkit.runtime.config import RunConfig
from hpkit.validation import parse_document

SEQ = 32
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # wavelengths of head_dim 16 at theta 1e4 fall below, inside and above the [16, 64] band
    "original_max_position_embeddings": 64,
}


def make_hf(
    out: Path, *, tied: bool = False, kv_heads: int = 2, scaling: dict | None = None, shard: str | None = None
) -> LlamaForCausalLM:
    """A tiny random Llama saved as transformers saves it: config.json + safetensors."""
    from transformers import LlamaConfig as HfLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = HfLlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_scaling=scaling,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms start at one; random ones catch a norm loaded into the wrong place
                p.uniform_(0.5, 1.5)
            elif "q_proj" in name or "k_proj" in name:
                # Sharp attention, so that a wrong rotary layout cannot hide behind near-uniform scores.
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return model


def hpkit_from(directory: Path):
    hf = read_hf_config(directory, SEQ)
    model = build_model(hf.cfg, "cpu")
    model.init_weights(0)
    stats = load_hf_weights(model, directory, hf)
    return model.eval(), stats


TOKENS = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("gqa-llama3-untied", {"scaling": LLAMA3_SCALING}),
        ("gqa-tied", {"tied": True}),
        (
            "mha-llama3-tied-sharded-files",
            {"kv_heads": 4, "scaling": LLAMA3_SCALING, "tied": True, "shard": "40KB"},
        ),
    ],
)
def test_logits_equal_transformers(tmp_path: Path, case: str, kwargs: dict) -> None:
    reference = make_hf(tmp_path / case, **kwargs)
    if kwargs.get("shard"):
        assert (tmp_path / case / INDEX_NAME).is_file(), "the case must read through an index file"
    model, stats = hpkit_from(tmp_path / case)
    with torch.no_grad():
        expected = reference(TOKENS).logits
        got = model(TOKENS)
    assert stats.tensors == len(list(model.parameters()))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_without_the_qk_permutation_the_logits_differ(tmp_path: Path) -> None:
    reference = make_hf(tmp_path / "m", scaling=LLAMA3_SCALING)
    model, _ = hpkit_from(tmp_path / "m")
    with torch.no_grad():
        for block in model.layers.values():
            for lin, heads in ((block.attention.wq, 4), (block.attention.wk, 2)):
                lin.weight.copy_(to_hf_rows(lin.weight, heads))
        assert (model(TOKENS) - reference(TOKENS).logits).abs().max() > 0.1


def test_without_llama3_rope_scaling_the_logits_differ(tmp_path: Path) -> None:
    reference = make_hf(tmp_path / "m", scaling=LLAMA3_SCALING)
    hf = read_hf_config(tmp_path / "m", SEQ)
    plain = dataclasses.replace(hf, cfg=dataclasses.replace(hf.cfg, rope_scaling=None))
    model = build_model(plain.cfg, "cpu")
    model.init_weights(0)
    load_hf_weights(model, tmp_path / "m", plain)
    with torch.no_grad():
        assert (model(TOKENS) - reference(TOKENS).logits).abs().max() > 0.1


def test_rotary_row_permutations_invert_each_other() -> None:
    rows = torch.arange(4 * 16 * 3, dtype=torch.float32).view(4 * 16, 3)
    assert torch.equal(to_hf_rows(to_runtime_rows(rows, 4), 4), rows)
    # head 0's row 1 (second of the first interleaved pair) is Hugging Face's row 8 (first of the second half)
    assert torch.equal(to_runtime_rows(rows, 4)[1], rows[8])


def _published(name: str) -> dict:
    # The Llama 3 8B and 70B config.json fields that set the shape, as Meta published them.
    dims = {"8B": (4096, 32, 32, 14336), "70B": (8192, 80, 64, 28672)}[name]
    return {
        "model_type": "llama",
        "hidden_size": dims[0],
        "num_hidden_layers": dims[1],
        "num_attention_heads": dims[2],
        "num_key_value_heads": 8,
        "intermediate_size": dims[3],
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }


@pytest.mark.parametrize("name", ["8B", "70B"])
def test_named_shapes_match_the_published_llama3_configs(name: str) -> None:
    published = parse_hf_config(_published(name), SHAPES[name].max_seq_len).cfg
    assert published == SHAPES[name]


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("attention_bias", {"attention_bias": True}),
        ("mlp_bias", {"mlp_bias": True}),
        ("hidden_act", {"hidden_act": "gelu"}),
        ("rope_scaling.rope_type", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        ("rope_parameters.rope_type", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
        ("rope_scaling.low_freq_factor", {"rope_scaling": {**LLAMA3_SCALING, "low_freq_factor": None}}),
        ("model_type", {"model_type": "mistral"}),
        ("num_key_value_heads", {"num_key_value_heads": 3}),
        ("hidden_size", {"hidden_size": None}),
    ],
)
def test_unrepresentable_configs_are_refused_naming_the_field(
    tmp_path: Path, field: str, change: dict
) -> None:
    data = {**_published("8B"), **change}
    (tmp_path / "config.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(SpecError) as err:
        read_hf_config(tmp_path, 64)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model.init_from: {tmp_path}/config.json: {field}: "), message


def test_transformers5_rope_parameters_are_read(tmp_path: Path) -> None:
    make_hf(tmp_path / "m", scaling=LLAMA3_SCALING)
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    hf = read_hf_config(tmp_path / "m", SEQ)
    assert hf.cfg.rope_scaling is not None and hf.cfg.rope_scaling.factor == 8.0
    assert hf.cfg.rope_theta == 10000.0 and hf.cfg.n_kv_heads == 2 and hf.cfg.head_dim == 16
    assert "rope_parameters" in saved or "rope_scaling" in saved


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_fields_a_config_leaves_out_take_transformers_own_defaults(model_type: str) -> None:
    # A trimmed or hand-written config.json must build the model transformers builds from it; the families'
    # defaults differ (Mixtral: 8 KV heads, rope_theta 1e6, eps 1e-5), and every default was Llama's.
    from transformers import AutoConfig

    from hpkit.models.llama.config_json import HF_DEFAULTS, HF_FAMILIES

    assert set(HF_DEFAULTS) == set(HF_FAMILIES)
    given = {"hidden_size": 256, "num_attention_heads": 16, "num_hidden_layers": 2, "intermediate_size": 512}
    given |= {"vocab_size": 1000} | (
        {"num_local_experts": 4, "num_experts_per_tok": 2} if model_type == "mixtral" else {}
    )
    theirs = AutoConfig.for_model(model_type, **given)
    ours = parse_hf_config({"model_type": model_type, **given}, SEQ)
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
    assert ours.cfg.n_kv_heads == theirs.num_key_value_heads
    assert ours.cfg.rope_theta == rope["rope_theta"]
    assert ours.cfg.norm_eps == theirs.rms_norm_eps
    assert ours.tied == theirs.tie_word_embeddings


def test_a_missing_directory_and_a_missing_tensor_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"config.json: no such file: point init_from at"):
        read_hf_config(tmp_path / "nowhere", SEQ)
    make_hf(tmp_path / "m")
    hf = read_hf_config(tmp_path / "m", SEQ)
    bigger = build_model(
        parse_hf_config(
            {**json.loads((tmp_path / "m" / "config.json").read_text()), "num_hidden_layers": 3}, SEQ
        ).cfg,
        "cpu",
    )
    with pytest.raises(SpecError, match=r"no tensor model\.layers\.2\.\S+ in its safetensors files$"):
        load_hf_weights(bigger, tmp_path / "m", hf)


def test_init_from_takes_the_shape_so_shape_fields_are_refused() -> None:
    cfg = parse_document(RunConfig, {"model": {"init_from": "/ckpt/llama", "seq_len": 64}})
    assert cfg.model.init_from == "/ckpt/llama"
    with pytest.raises(SpecError, match=r"model.*dim cannot be given with init_from"):
        parse_document(RunConfig, {"model": {"init_from": "/ckpt/llama", "dim": 64}})
    with pytest.raises(SpecError, match=r"name cannot be given with init_from"):
        parse_document(RunConfig, {"model": {"init_from": "/ckpt/llama", "name": "8B"}})


def test_export_of_a_checkpoint_without_a_model_record_says_what_to_do(tmp_path: Path) -> None:
    from hpkit.errors import HpkitError
    from hpkit.hf_export import export_hf
    from hpkit.runtime.checkpoints.checkpoint_record import CommitRecord, write_record

    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    write_record(step, CommitRecord(10, {}, 2))  # as hpkit saved before it recorded the model
    with pytest.raises(HpkitError, match=r"has no model config .*: resume the run for one step"):
        export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
