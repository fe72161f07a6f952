"""Every layout that fits one GPU trains like the CPU reference, within what bf16 and TF32 allow.

Tolerances (relative, per step, over 6 steps of a small model):
- fp32 on CUDA vs fp32 on CPU: 1e-4 for the loss, 1e-3 for the gradient norm. Different kernels sum in a different
  order; PyTorch leaves TF32 off for matmuls by default, which hpkit keeps (with TF32 on, expect ~1e-3).
- bf16 (autocast, fp32 master weights) vs the fp32 CPU reference: 2e-2 for the loss, 1e-1 for the gradient norm: bf16
  keeps 8 bits of mantissa (relative rounding 2^-8 ≈ 4e-3 per operation), and norms of small gradients drift more.
"""

from __future__ import annotations

import pytest
from _gpu import series, train, worst_relative

pytestmark = pytest.mark.gpu

BASE = {
    "name": "gpu-layouts",
    "parallelism": {"dp_shard": 1},
    "model": {
        "name": "debug",
        "dim": 128,
        "n_layers": 4,
        "n_heads": 4,
        "ffn_dim": 256,
        "vocab_size": 512,
        "seq_len": 64,
    },
    "train": {
        "steps": 6,
        "local_batch_size": 4,
        "lr": 3e-3,
        "grad_clip": 0.5,
        "seed": 7,
        "mixed_precision": "fp32",
    },
}

# name -> (train overrides, loss tolerance, grad-norm tolerance)
LAYOUTS = {
    "fp32": ({}, 1e-4, 1e-3),
    "fp32_ac_full": ({"activation_checkpoint": "full"}, 1e-4, 1e-3),
    "fp32_ac_selective": ({"activation_checkpoint": "selective"}, 1e-4, 1e-3),
    "fp32_compile": ({"compile": True}, 1e-4, 1e-3),
    "bf16": ({"mixed_precision": "bf16"}, 2e-2, 1e-1),
    "bf16_ac_full_compile": (
        {"mixed_precision": "bf16", "activation_checkpoint": "full", "compile": True},
        2e-2,
        1e-1,
    ),
}


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory) -> list[dict]:
    return train(BASE, tmp_path_factory.mktemp("cpu-ref"), cpu=True)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_cpu_reference(name, cpu_reference, tmp_path):
    overrides, loss_tol, norm_tol = LAYOUTS[name]
    config = {**BASE, "train": {**BASE["train"], **overrides}}
    got = train(config, tmp_path / name, cpu=False)
    stdout = (tmp_path / name / "stdout.txt").read_text()
    assert "device=cuda" in stdout, f"{name} did not run on the GPU:\n{stdout[-2000:]}"
    loss = worst_relative(series(got, "loss"), series(cpu_reference, "loss"))
    norm = worst_relative(series(got, "grad_norm"), series(cpu_reference, "grad_norm"))
    assert loss <= loss_tol, f"{name}: loss differs from the CPU reference by {loss:.2e} (allowed {loss_tol})"
    assert norm <= norm_tol, f"{name}: grad norm differs by {norm:.2e} (allowed {norm_tol})"
    assert series(got, "loss")[-1] < series(got, "loss")[0], f"{name}: the loss did not fall"
