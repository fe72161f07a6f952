from __future__ import annotations

import io
import json

import pytest

from hpkit.errors import SpecError
from hpkit.models.llama.model import SHAPES, config_for
from hpkit.runtime.observe.metrics import MetricsLogger, StepStats, peak_tflops


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "cuda", "bf16") == pytest.approx(989.5)
    assert peak_tflops("NVIDIA H100 PCIe", "cuda", "bf16") == pytest.approx(756.0)
    assert peak_tflops("NVIDIA H200", "cuda", "bf16") == pytest.approx(989.5)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "cuda", "fp32") == pytest.approx(156.0)
    assert peak_tflops("Some Future GPU", "cuda", "bf16") is None
    assert peak_tflops("x86_64", "cpu", "bf16") is None


def _stats(peak):
    return StepStats(3, 2.5, 1.0, 1e-3, 0.5, 4096, 4, 1e9, peak, 1.0, "max_rss")


def test_step_stats_arithmetic():
    s = _stats(peak=10.0)
    assert s.tokens_per_s == pytest.approx(8192)
    assert s.tflops_per_device == pytest.approx(1e9 * 8192 / 4 / 1e12)
    assert s.mfu == pytest.approx(s.tflops_per_device / 10.0)
    assert _stats(peak=None).mfu is None
    assert "MFU n/a" in _stats(peak=None).line()


def test_logger_writes_jsonl_on_rank0_only(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    out = io.StringIO()
    log = MetricsLogger(enabled=True, jsonl_path=path, tensorboard_dir=None, stream=out)
    log.log(_stats(None))
    log.close()
    record = json.loads(path.read_text())
    assert record["step"] == 3 and record["loss"] == 2.5 and record["mfu"] is None
    assert "loss 2.5000" in out.getvalue()
    quiet = MetricsLogger(enabled=False, jsonl_path=tmp_path / "other.jsonl", tensorboard_dir=None)
    quiet.log(_stats(None))
    assert not (tmp_path / "other.jsonl").exists()


def test_debug_shape_matches_torchtitan():
    assert SHAPES["debug"].num_params() == 6_163_712  # 6.16M, torchtitan's llama3 debug model
    assert 120e6 < SHAPES["125M"].num_params() < 140e6
    assert 7.9e9 < SHAPES["8B"].num_params() < 8.1e9


def test_config_overrides():
    cfg = config_for("debug", 64, dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=256)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (64, 2, 4, 4, 16)
    with pytest.raises(SpecError, match="model: dim=60 is not divisible by n_heads=8"):
        config_for("debug", 64, dim=60, n_heads=8)
