"""One table of SMP parameters (hpkit.smp_params): the importer and smp.init give every parameter the same
answer. Each test here fails on one of the disagreements the table replaced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.compat.smp.topology import SmpConfig
from hpkit.compat.smp.unsupported import SmpExit
from hpkit.errors import SpecError
from hpkit.sagemaker.convert import convert
from hpkit.sagemaker.estimator import Estimator
from hpkit.smp_params import SMP_PARAMETERS
from hpkit.validation import parse_document

REPO = Path(__file__).resolve().parents[2]

# A value each parameter may take in an estimator; refused ones are asked for (true).
SAMPLE = {
    "tensor_parallel_degree": 2,
    # (a pipeline needs as many microbatches as stages: both sides check that too)
    "pipeline_parallel_degree": 2,
    "partitions": 2,
    "microbatches": 2,
    "ddp": True,
    "pipeline": "simple",
    "bf16": True,
}


def _import(params: dict):
    est = {
        "entry_point": "train.py",
        "instance_type": "ml.p4d.24xlarge",
        "instance_count": 1,
        "distribution": {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}}},
    }
    return convert(parse_document(Estimator, est, "est.yaml"), source="est.yaml")


def _init_refuses(params: dict) -> bool:
    try:
        SmpConfig.from_parameters(params)
    except SmpExit:
        return True
    return False


@pytest.mark.parametrize("name", sorted(SMP_PARAMETERS))
def test_the_importer_keeps_exactly_what_smp_init_accepts(name):
    for value in {SAMPLE.get(name, True), False} if name not in SAMPLE else {SAMPLE[name]}:
        params = {name: value}
        if name in ("pipeline_parallel_degree", "partitions"):
            params["microbatches"] = 2
        refused = _init_refuses(params)
        try:
            result = _import(params)
        except SpecError as exc:
            assert refused, f"the importer refused {params} that smp.init runs: {exc}"
            assert f"parameters.{name}:" in str(exc)
            continue
        assert not refused, f"the importer kept {params}, which smp.init then refuses"
        assert result.data.get("smp_parameters") == params


def test_prescaled_batch_true_is_what_hpkit_does_and_false_is_refused_everywhere():
    assert not _init_refuses({"prescaled_batch": True})
    assert _import({"prescaled_batch": True}).data["smp_parameters"] == {"prescaled_batch": True}
    assert _init_refuses({"prescaled_batch": False})
    with pytest.raises(SpecError, match="prescaled_batch=False is not supported"):
        _import({"prescaled_batch": False})


def test_skip_tracing_gets_one_advice_from_the_importer_and_from_smp_init(capsys):
    advice = SMP_PARAMETERS["skip_tracing"].advice
    warning = next(w for w in _import({"skip_tracing": True}).warnings if w.field.endswith("skip_tracing"))
    assert advice in warning.line()
    config = SmpConfig.from_parameters({"skip_tracing": True})
    assert config.ignored == {"skip_tracing": True}
    from hpkit.compat.smp.unsupported import warn_ignored

    warn_ignored("skip_tracing", True)
    assert advice in capsys.readouterr().err


BF16_PROBE = """
import os, torch
import smdistributed.modelparallel.torch as smp
smp.init({"bf16": BF16})
model = smp.DistributedModel(torch.nn.Linear(4, 4))
out = model(torch.ones(2, 4))
print("DTYPE", out.dtype, next(model.parameters()).dtype)
"""


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_is_read_the_model_computes_in_bfloat16_and_keeps_fp32_weights(tmp_path, bf16):
    shim = subprocess.run(
        [sys.executable, "-m", "hpkit.compat"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "python")},
    ).stdout.strip()  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([shim, str(REPO / "python")]),
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
    }  # fmt: skip
    env.pop("HPKIT_SPEC", None)
    proc = subprocess.run(
        [sys.executable, "-c", BF16_PROBE.replace("BF16", str(bf16))],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    dtype = "torch.bfloat16" if bf16 else "torch.float32"
    assert f"DTYPE {dtype} torch.float32" in proc.stdout, proc.stdout + proc.stderr
