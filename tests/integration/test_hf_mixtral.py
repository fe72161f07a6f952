"""A Hugging Face Mixtral checkpoint loads through model.init_from, on one process and under expert parallel,
with logits equal to transformers' own MixtralForCausalLM (an implementation no one here wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _torchrun import run

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

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
    from transformers import MixtralForCausalLM

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


def _hpkit_logits_from_checkpoint(step_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    from hpkit.models.llama.model import build_model, config_from_dict
    from hpkit.runtime.checkpoints.checkpoint_record import read_record

    record = read_record(step_dir)
    assert record.model["family"] == "moe"
    model = build_model(config_from_dict(record.model["config"]), "cpu")
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        return model.eval()(tokens)


def test_an_expert_parallel_run_exports_a_mixtral_that_transformers_loads(mixtral_dir, tmp_path, capsys):
    from transformers import MixtralForCausalLM

    from hpkit.commands import ckpt

    ckpt_dir = tmp_path / "ckpt"
    spec = {
        "name": "mixtral-finetune",
        "output_dir": str(tmp_path / "logs"),
        "parallelism": {"dp_shard": 1, "ep": 2},
        "model": {"init_from": str(mixtral_dir), "seq_len": 32},
        "train": {
            "steps": 3,
            "local_batch_size": 2,
            "lr": 1e-2,
            "mixed_precision": "fp32",
            "tensorboard": False,
        },
        "checkpoint": {"dir": str(ckpt_dir), "interval": 100},
    }
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(spec), encoding="utf-8")
    trained = run(["-m", "hpkit", "train", "--config", str(config)], tmp_path, nproc=2)
    assert "done steps=3" in trained.stdout and "layout=ep:2" in trained.stdout, trained.stdout

    out = tmp_path / "export"
    assert ckpt.main(["export", "--hf", str(ckpt_dir), str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 4
    assert saved["num_experts_per_tok"] == 2

    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    exported = MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = exported(tokens).logits
        before = MixtralForCausalLM.from_pretrained(mixtral_dir).eval()(tokens).logits
    ours = _hpkit_logits_from_checkpoint(ckpt_dir / "step-00000003", tokens)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    assert (theirs - before).abs().max() > 1e-3, "training changed nothing: the comparison proves nothing"
