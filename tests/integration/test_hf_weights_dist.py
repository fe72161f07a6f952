"""Hugging Face Llama weights in and out across layouts, against transformers (an implementation no one here wrote).

- model.init_from under FSDP 2, TP 2 and PP 2 (one torchrun launch runs the three, one after the other): the
  logits on a fixed batch and the first step's loss equal transformers' on the same tokens, and each rank read
  only about its share of the bytes.
- `hpkit train` from init_from for 3 steps (FSDP 2, checkpointing), then a resume on one process, which takes the
  checkpoint and not init_from; `hpkit ckpt export --hf` of either checkpoint (FSDP-sharded, single) loads in
  transformers, whose logits equal hpkit's own from that checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import yaml
from _torchrun import REPO, run

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

from hpkit.commands import ckpt
from hpkit.errors import HpkitError
from hpkit.models.llama.model import build_model, config_from_dict
from hpkit.runtime.checkpoints.checkpoint_record import read_record

sys.path.insert(0, str(REPO / "tests" / "unit"))
from test_hf_weights import LLAMA3_SCALING, make_hf

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    make_hf(out, scaling=LLAMA3_SCALING)  # GQA (4 heads, 2 kv heads), llama3 rope scaling, untied
    return out


def _reference(hf_dir: Path) -> LlamaForCausalLM:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


LAYOUTS = {
    "fsdp2": {"dp_shard": 2},
    "tp2": {"dp_shard": 1, "tp": 2},
    "pp2": {"dp_shard": 1, "pp": 2, "microbatches": 2},
}


@pytest.fixture(scope="module")
def layouts_out(hf_dir: Path, tmp_path_factory) -> Path:
    """Every layout's record from one torchrun launch (each layout builds its own trainer in the launch's
    process group): the launch, not the layouts, is what costs here."""
    tmp = tmp_path_factory.mktemp("hf-layouts")
    run([str(HERE / "hf_layouts.py"), str(hf_dir), str(tmp / "out"), json.dumps(LAYOUTS)], tmp, nproc=2)
    return tmp / "out"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_step_matches_transformers(hf_dir: Path, layouts_out: Path, layout: str) -> None:
    out = layouts_out / f"{layout}.pt"
    got = torch.load(out, weights_only=False)
    reference = _reference(hf_dir)
    with torch.no_grad():
        if got["logits"] is not None:  # a pipeline stage gives none: its loss says it all
            torch.testing.assert_close(got["logits"], reference(got["tokens"]).logits, atol=ATOL, rtol=0)
        per_rank = [
            F.cross_entropy(reference(inputs).logits.flatten(0, 1), labels.flatten())
            for inputs, labels in got["batches"].values()
        ]
    assert got["loss"] == pytest.approx(float(torch.stack(per_rank).mean()), abs=ATOL)
    if layout == "tp2":  # loss parallel: the vocabulary stays sharded, no logit gather in the step
        assert got["logits_placements"] == ["S(2)"], got["logits_placements"]
    # Each rank read its half of the weights (q/k by whole heads; TP keeps the small norms whole).
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    for read in got["bytes_read"]:
        assert 0.45 * total < read < 0.55 * total, (read, total)


def _hpkit_logits_from_checkpoint(step_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    record = read_record(step_dir)
    model = build_model(config_from_dict(record.model["config"]), "cpu")
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        return model.eval()(tokens)


def test_train_resume_and_export_round_trip(hf_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import LlamaForCausalLM

    ckpt_dir = tmp_path / "ckpt"
    spec = {
        "name": "hf-finetune",
        "output_dir": str(tmp_path / "logs"),
        "parallelism": {"dp_shard": -1},
        "model": {"init_from": str(hf_dir), "seq_len": 32},
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
    first = run(["-m", "hpkit", "train", "--config", str(config)], tmp_path, nproc=2)
    assert f"hpkit train: loaded 21 tensors from {hf_dir}" in first.stdout, first.stdout
    assert "done steps=3" in first.stdout

    # A checkpoint of the run takes precedence over init_from (one process now: DCP reshards).
    second = run(["-m", "hpkit", "train", "--config", str(config), "--steps", "4"], tmp_path, nproc=None)
    assert "resumed from" in second.stdout and "loaded" not in second.stdout, second.stdout

    out = tmp_path / "export"
    capsys.readouterr()
    assert ckpt.main(["export", "--hf", str(ckpt_dir), str(out), "--max-shard-gib", "0.0001"]) == 0
    said = capsys.readouterr().out
    assert "step-00000004" in said and "21 tensors" in said, said
    assert (out / "model.safetensors.index.json").is_file()
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_scaling"]["rope_type"] == "llama3" and saved["num_key_value_heads"] == 2

    # And step 3, saved sharded by FSDP over 2 ranks, as one file.
    sharded = tmp_path / "export-step3"
    assert ckpt.main(["export", "--hf", str(ckpt_dir / "step-00000003"), str(sharded)]) == 0
    assert (sharded / "model.safetensors").is_file()

    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = _reference(hf_dir)(tokens).logits
    for directory, step in ((out, "step-00000004"), (sharded, "step-00000003")):
        exported = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        ours = _hpkit_logits_from_checkpoint(ckpt_dir / step, tokens)
        with torch.no_grad():
            theirs = exported(tokens).logits
        torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)
        assert (theirs - before).abs().max() > 1e-3, "training changed nothing: the comparison proves nothing"

    with pytest.raises(HpkitError, match=r"export: not empty: export into a new directory"):
        ckpt.main(["export", "--hf", str(ckpt_dir), str(out)])
