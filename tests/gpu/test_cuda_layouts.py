"""Every layout that fits one GPU trains like one plain fp32 GPU process, within what bf16 allows.

The reference runs on the GPU too: one seed gives other initial weights on CUDA than on the CPU (each draws from
its own device's generator; on an H100 every fp32 layout's losses differed from the CPU run's by 1.4e-2, alike).

Tolerances (relative, per step, over 6 steps of a small model):
- fp32 layouts (activation checkpointing, compile) vs the fp32 reference: 1e-4 for the loss, 1e-3 for the gradient
  norm (recomputation and fused kernels sum in another order; PyTorch leaves TF32 off for matmuls, as hpkit does);
- bf16 (autocast, fp32 master weights) vs the fp32 reference: 2e-2 for the loss, 1e-1 for the gradient norm: bf16
  keeps 8 bits of mantissa (relative rounding 2^-8 ≈ 4e-3 per operation), and norms of small gradients drift more.
"""

from __future__ import annotations

import pytest
from _gpu import TINY_MODEL, series, train, worst_relative

pytestmark = pytest.mark.gpu

BASE = {
    "name": "gpu-layouts",
    "parallelism": {"dp_shard": 1},
    "model": TINY_MODEL,
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
def reference(tmp_path_factory) -> list[dict]:
    return train(BASE, tmp_path_factory.mktemp("gpu-ref"), cpu=False)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_one_gpu_process(name, reference, tmp_path):
    overrides, loss_tol, norm_tol = LAYOUTS[name]
    config = {**BASE, "train": {**BASE["train"], **overrides}}
    got = train(config, tmp_path / name, cpu=False)
    stdout = (tmp_path / name / "stdout.txt").read_text()
    assert "device=cuda" in stdout, f"{name} did not run on the GPU:\n{stdout[-2000:]}"
    loss = worst_relative(series(got, "loss"), series(reference, "loss"))
    norm = worst_relative(series(got, "grad_norm"), series(reference, "grad_norm"))
    assert loss <= loss_tol, (
        f"{name}: loss differs from the fp32 GPU reference by {loss:.2e} (allowed {loss_tol})"
    )
    assert norm <= norm_tol, f"{name}: grad norm differs by {norm:.2e} (allowed {norm_tol})"
    assert series(got, "loss")[-1] < series(got, "loss")[0], f"{name}: the loss did not fall"
