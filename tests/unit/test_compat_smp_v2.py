"""SMP v2 plumbing: the spec's compat entry and parameters, the rendered task step, the importer's choice of
v2 over v1, and `import torch.sagemaker` finding hpkit's layer only after it is installed."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.sagemaker.convert import convert
from hpkit.sagemaker.estimator import Estimator
from hpkit.slurm.script import compat_step
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def spec(**fields):
    return parse_document(JobSpec, {"name": "v2", "nodes": 2, "tasks_per_node": 2, **fields})


def test_smp_v2_parameters_are_checked_against_the_job():
    ok = spec(compat=["smp_v2"], smp_parameters={"hybrid_shard_degree": 2, "tensor_parallel_degree": 2})
    assert ok.job.compat == ["smp_v2"]
    cases = {
        "tensor_parallel_degree=3 does not divide the job's 4 ranks": {"tensor_parallel_degree": 3},
        "hybrid_shard_degree=3 must divide the 4 data-parallel ranks": {"hybrid_shard_degree": 3},
        "'pipeline_parallel_degree' is not an SMP v2 parameter": {"pipeline_parallel_degree": 2},
        "context_parallel_degree=2 is not supported by hpkit": {"context_parallel_degree": 2},
        "be a multiple of expert_parallel_degree=4": {
            "hybrid_shard_degree": 2,
            "expert_parallel_degree": 4,
        },
    }
    for words, params in cases.items():
        with pytest.raises(SpecError) as err:
            spec(compat=["smp_v2"], smp_parameters=params)
        message = str(err.value)
        assert len(message.splitlines()) == 1 and words in message and "smp_parameters" in message, message
    with pytest.raises(SpecError, match="exclude each other"):
        spec(compat=["smp", "smp_v2"])


def test_the_task_step_preloads_the_layer_and_exports_the_parameters():
    step = compat_step(spec(compat=["smp_v2"], smp_parameters={"tensor_parallel_degree": 2}).job)
    assert "export HPKIT_PRELOAD=hpkit.compat.smp_v2:install" in step
    words = shlex.split(step.rpartition("export ")[2])
    assert words == ['HPKIT_SMP_V2_CONFIG={"tensor_parallel_degree":2}']
    assert "HPKIT_PRELOAD" not in compat_step(spec(compat=["smp"]).job)


def _estimator(distribution: dict) -> Estimator:
    return Estimator.model_validate(
        {
            "entry_point": "train.py",
            "role": "r",
            "instance_type": "ml.p4d.24xlarge",
            "instance_count": 2,
            "distribution": distribution,
        }
    )


def test_torch_distributed_with_modelparallel_imports_as_smp_v2():
    v2 = {
        "torch_distributed": {"enabled": True},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"hybrid_shard_degree": 8}}},
    }
    imported = convert(_estimator(v2))
    assert imported.spec.job.compat == ["smp_v2"] and imported.spec.job.launcher == "torchrun"
    assert imported.spec.job.smp_parameters == {"hybrid_shard_degree": 8}
    v1 = {
        "mpi": {"enabled": True, "processes_per_host": 8},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"tensor_parallel_degree": 2}}},
    }
    assert convert(_estimator(v1)).spec.job.compat == ["smp"]
    bad = {
        "torch_distributed": {"enabled": True},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"microbatches": 4}}},
    }
    with pytest.raises(SpecError) as err:
        convert(_estimator(bad))
    assert "modelparallel.parameters.microbatches" in str(err.value)


def test_torch_sagemaker_is_found_only_once_installed(tmp_path):
    code = (
        "import importlib.util, json\n"
        "before = importlib.util.find_spec('torch.sagemaker') is not None\n"
        "from hpkit.compat import smp_v2\n"
        "smp_v2.install()\n"
        "import torch.sagemaker as tsm, torch.distributed.fsdp as f\n"
        "from torch.sagemaker.tensor_parallel.transformer import TransformerLayer\n"
        "import transformer_engine\n"
        "print(json.dumps([before, tsm.__name__, f.FullyShardedDataParallel.__module__,"
        " tsm.init.__module__, transformer_engine._hpkit_stand_in]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, name, fsdp_module, init_module, stand_in = json.loads(done.stdout)
    assert before is False
    assert name == "hpkit.compat.smp_v2.tsm" and fsdp_module == "hpkit.compat.smp_v2.fsdp"
    assert init_module == "hpkit.compat.smp_v2.state" and stand_in is True
