"""A checkpoint saved on CUDA resumes on the CPU, and one saved on the CPU resumes on CUDA, continuing the same run.

The reference is the uninterrupted run on the device that saved: one seed gives other initial weights on CUDA than
on the CPU (each draws from its own device's generator; on an H100 the first losses differed by 3 %), so only the
steps after the resume cross devices, and those must match within fp32's kernel-order differences.
"""

from __future__ import annotations

import pytest
from _gpu import series, train, worst_relative

pytestmark = pytest.mark.gpu

BASE = {
    "name": "gpu-ckpt",
    "parallelism": {"dp_shard": 1},
    "model": {
        "name": "debug",
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "ffn_dim": 128,
        "vocab_size": 256,
        "seq_len": 32,
    },
    "train": {"steps": 6, "local_batch_size": 4, "lr": 3e-3, "seed": 11, "mixed_precision": "fp32"},
}


def _with_checkpoints(path) -> dict:
    return {**BASE, "checkpoint": {"dir": str(path), "interval": 3, "keep": 2, "save_final": False}}


@pytest.mark.parametrize(("first", "second"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_devices(first, second, tmp_path):
    whole = train(BASE, tmp_path / "whole", cpu=first == "cpu")
    config = _with_checkpoints(tmp_path / "ckpt")
    head = train(config, tmp_path / "head", cpu=first == "cpu", steps=3)
    tail = train(config, tmp_path / "tail", cpu=second == "cpu")
    stdout = (tmp_path / "tail" / "stdout.txt").read_text()
    assert "resumed from" in stdout and "at step 3" in stdout, stdout[-2000:]
    assert [r["step"] for r in tail if "loss" in r] == [4, 5, 6]
    joined = series(head, "loss") + series(tail, "loss")
    assert worst_relative(joined, series(whole, "loss")) <= 1e-4
