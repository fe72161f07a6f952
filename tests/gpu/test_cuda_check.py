"""The CUDA half of `hpkit check --profile compute`, run for real: each verdict agrees with nvidia-smi and torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _gpu import REPO

pytestmark = pytest.mark.gpu


def _check() -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    done = subprocess.run(
        [sys.executable, "-m", "hpkit", "check", "--profile", "compute", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    return {c["name"]: c for c in report["checks"]}


def _smi(query: str) -> list[str]:
    if shutil.which("nvidia-smi") is None:
        pytest.fail("nvidia-smi is not on PATH on this GPU machine")
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def test_gpu_count_and_model_match_nvidia_smi_and_torch():
    import torch

    checks = _check()
    names = _smi("name")
    assert checks["gpus"]["status"] in ("PASS", "WARN"), checks["gpus"]
    assert checks["gpus"]["detail"].startswith(f"{len(names)} × "), (checks["gpus"], names)
    assert torch.cuda.device_count() == len(names)
    assert any(word in checks["gpus"]["detail"] for word in names[0].split() if len(word) > 3), (
        checks["gpus"],
        names,
    )


def test_driver_and_cuda_verdicts_match():
    import torch

    checks = _check()
    driver = _smi("driver_version")[0]
    assert checks["nvidia-driver"]["status"] == "PASS", checks["nvidia-driver"]
    assert driver in checks["nvidia-driver"]["detail"], (checks["nvidia-driver"], driver)
    assert checks["cuda"]["status"] == "PASS", checks["cuda"]
    assert torch.version.cuda in checks["cuda"]["detail"], (checks["cuda"], torch.version.cuda)
    assert (
        checks["torch"]["status"] == "PASS" and torch.__version__.split("+")[0] in checks["torch"]["detail"]
    )
