"""A Hugging Face Mixtral checkpoint loads through model.init_from, on one process and under expert parallel,
with logits equal to transformers' own MixtralForCausalLM (an implementation no one here wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _torchrun import run
from transformers import MixtralConfig, MixtralForCausalLM

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("nproc", "parallelism"),
    [(None, {"dp_shard": 1}), (2, {"dp_shard": 1, "ep": 2})],
    ids=["one_process", "ep2"],
)
def test_mixtral_loads_with_the_logits_of_transformers(mixtral_dir, tmp_path, nproc, parallelism):
    out = tmp_path / "out.pt"
    run(
        [str(HERE / "hf_layouts.py"), str(mixtral_dir), str(out), json.dumps(parallelism)],
        tmp_path,
        nproc=nproc,
    )
    got = torch.load(out, weights_only=False)
    reference = MixtralForCausalLM.from_pretrained(mixtral_dir).eval()
    with torch.no_grad():
        expected = reference(got["tokens"]).logits.float()
    assert got["logits"].shape == expected.shape
    worst = (got["logits"] - expected).abs().max().item()
    assert worst <= 1e-4, f"max |hpkit - transformers| = {worst:.2e}"
    # A model whose experts were not loaded (or loaded into the wrong ranks) is far off, not near.
    assert expected.abs().max().item() > 1e-2
