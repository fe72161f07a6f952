"""`hpkit import-sagemaker` on the estimator configs of the seeds (000, 002, 003), field by field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.sagemaker.convert import convert
from hpkit.sagemaker.estimator import Estimator
from hpkit.smp_params import SMP_PARAMETERS
from hpkit.spec import JobSpec
from hpkit.validation import load_document, parse_document

SMP_MPI = {
    "enabled": True,
    "processes_per_host": 8,
    "custom_mpi_options": "--mca btl_vader_single_copy_mechanism none ",
}
SEED_000 = {
    "entry_point": "your_training_script.py",
    "role": "role",
    "instance_type": "ml.p3.16xlarge",
    "framework_version": "1.13.1",
    "py_version": "py36",
    "instance_count": 1,
    "base_job_name": "SMD-MP-demo",
    "inputs": "s3://my_bucket/my_training_data/",
}


def imported(estimator: dict):
    return convert(parse_document(Estimator, estimator, "est.yaml"), source="est.yaml")


def warned(result) -> dict[str, str]:
    return {w.field: w.line() for w in result.warnings}


def test_seed_000_tensor_parallel_only():
    smp = {
        "enabled": True,
        "parameters": {
            "pipeline_parallel_degree": 1,
            "placement_strategy": "cluster",
            "tensor_parallel_degree": 4,
            "ddp": True,
        },
    }
    result = imported({**SEED_000, "distribution": {"smdistributed": {"modelparallel": smp}, "mpi": SMP_MPI}})
    assert result.data == {
        "name": "SMD-MP-demo",
        "nodes": 1,
        "instance_type": "ml.p3.16xlarge",
        # ml.p3.16xlarge: 8 × V100 in hpkit's catalog, one rank per GPU.
        "gpus_per_node": 8,
        "launcher": "mpi",
        # mpirun's --mca carries over as Open MPI's environment variable.
        "env": {"OMPI_MCA_btl_vader_single_copy_mechanism": "none"},
        "command": ["python3", "your_training_script.py"],
        "parallelism": {"dp_replicate": -1, "dp_shard": 1, "tp": 4},
        # The script's smp.* calls run on hpkit's compat layer, which reads SMP's own names from here.
        "smp_parameters": smp["parameters"],
        "compat": ["smp"],
        "sagemaker_env": {"channels": {"training": "/opt/ml/input/data/training"}},
    }
    spec = result.spec
    assert (spec.job.world_size, spec.job.gpus_per_node) == (8, 8)
    assert spec.run.parallelism.resolve(8) == {"dp_replicate": 2, "dp_shard": 1, "ep": 1, "tp": 4, "pp": 1}
    assert sorted(warned(result)) == sorted(
        [
            "distribution.smdistributed.modelparallel.parameters.placement_strategy",
            "inputs.training",
            "role",
            "framework_version",
            "py_version",
        ]
    )
    lines = warned(result)
    # The advice is the one table's (hpkit.smp_params), the same that smp.init gives.
    placement = lines["distribution.smdistributed.modelparallel.parameters.placement_strategy"]
    assert SMP_PARAMETERS["placement_strategy"].advice in placement
    # No more "port the script's smp calls": the compat layer runs them.
    assert [n.split(":")[0] for n in result.notes] == ["distribution.smdistributed.modelparallel"]
    assert "compat: [smp]" in result.notes[0] and "port" not in result.notes[0]
    assert "s3://my_bucket/my_training_data/" in lines["inputs.training"]


def test_seed_000_tensor_and_pipeline_parallel():
    smp = {
        "enabled": True,
        "parameters": {
            "microbatches": 4,
            "pipeline_parallel_degree": 2,
            "placement_strategy": "cluster",
            "tensor_parallel_degree": 2,
            "ddp": True,
        },
    }
    result = imported({**SEED_000, "distribution": {"smdistributed": {"modelparallel": smp}, "mpi": SMP_MPI}})
    assert result.data["parallelism"] == {
        "dp_replicate": -1,
        "dp_shard": 1,
        "tp": 2,
        "pp": 2,
        "microbatches": 4,
    }
    assert result.spec.run.parallelism.resolve(8) == {
        "dp_replicate": 2,
        "dp_shard": 1,
        "ep": 1,
        "tp": 2,
        "pp": 2,
    }
    assert result.data["launcher"] == "mpi"


def test_seed_002_basic_mpi_on_cpu_instances():
    result = imported(
        {
            "entry_point": "mpi_demo.py",
            "role": "role",
            "framework_version": "2.3.0",
            "py_version": "py37",
            "instance_count": 3,
            "instance_type": "ml.c5.2xlarge",
            "distribution": {"mpi": {"enabled": True, "processes_per_host": 2}},
            "output_path": "s3://bucket/mpi",
        }
    )
    assert result.data == {
        "name": "mpi_demo",
        "nodes": 3,
        "instance_type": "ml.c5.2xlarge",
        "tasks_per_node": 2,
        "launcher": "mpi",
        "command": ["python3", "mpi_demo.py"],
        "sagemaker_env": {"channels": {}},
    }
    assert result.spec.job.world_size == 6
    # ml.c5.2xlarge is a CPU type in the catalog: no GPUs, and nothing to warn about.
    assert sorted(warned(result)) == ["framework_version", "output_path", "py_version", "role"]
    assert "SM_MODEL_DIR" in warned(result)["output_path"]


def test_seed_002_sm_hosts_script_without_distribution_runs_once_per_host():
    result = imported(
        {
            "entry_point": "train.py",
            "instance_count": 2,
            "instance_type": "ml.c5.2xlarge",
            "hyperparameters": {"backend": "gloo", "model-type": "custom"},
        }
    )
    assert result.data["launcher"] == "srun"
    assert "tasks_per_node" not in result.data and "gpus_per_node" not in result.data
    assert result.data["command"] == ["python3", "train.py", "--backend", "gloo", "--model-type", "custom"]
    assert result.spec.job.world_size == 2
    script = render(result.spec)
    # SM_HOSTS is each step's nodes, set by the job's supervisor.
    assert '"sagemaker_hosts": true' in script and "SM_CURRENT_HOST=$SLURMD_NODENAME" in script


def test_seed_002_misspelled_enable_is_off_as_on_sagemaker_and_warned():
    # {"pytorchddp": {"enable": True}}: SageMaker reads "enabled", so it ran one process seeing 4 GPUs.
    result = imported(
        {
            "entry_point": "ddp.py",
            "instance_count": 1,
            "instance_type": "ml.g5.12xlarge",
            "hyperparameters": {"backend": "gloo", "model-type": "custom"},
            "distribution": {"pytorchddp": {"enable": True}},
        }
    )
    assert result.data["launcher"] == "srun"
    assert (result.data["gpus_per_node"], result.data["tasks_per_node"]) == (4, 1)
    assert result.spec.job.world_size == 1
    line = warned(result)["distribution.pytorchddp.enable"]
    assert "reads 'enabled'" in line and "distribution.pytorchddp.enabled: true" in line


@pytest.mark.parametrize(
    "distribution",
    [{"pytorchddp": {"enabled": True}}, {"torch_distributed": {"enabled": True}}],
    ids=["pytorchddp", "torch_distributed"],
)
def test_seed_002_ddp_on_p4d_uses_torchrun_one_rank_per_gpu(distribution):
    result = imported(
        {
            "entry_point": "train.py",
            "source_dir": "subdirectory-to-your-code",
            "instance_count": 2,
            "instance_type": "ml.p4d.24xlarge",
            "distribution": distribution,
        }
    )
    assert result.data["launcher"] == "torchrun"
    assert result.data["gpus_per_node"] == 8 and "tasks_per_node" not in result.data
    assert result.data["command"] == ["python3", "subdirectory-to-your-code/train.py"]
    assert result.spec.job.world_size == 16
    assert result.warnings == []
    assert result.spec.run.collectives.backend == "auto"


def test_seed_002_smddp_on_a_supported_type():
    result = imported(
        {
            "entry_point": "train.py",
            "instance_count": 2,
            "instance_type": "ml.p4d.24xlarge",
            "distribution": {"smdistributed": {"dataparallel": {"enabled": True}}},
        }
    )
    assert result.data["launcher"] == "torchrun"
    # The real library where the image has it, else the compat layer's alias: the script runs either way.
    assert result.data["collectives"] == {"backend": "smddp", "smddp_fallback": True}
    assert result.data["compat"] == ["smddp"]
    assert result.warnings == []
    assert len(result.notes) == 1 and "SMDDP_WHEEL_URL" in result.notes[0]
    assert "smddp_fallback: false" in result.notes[0]


def test_seed_003_pytorchddp_with_string_true():
    result = imported(
        {
            "base_job_name": "pytorch-dataparallel-mnist",
            "source_dir": "code",
            "entry_point": "my_model.py",
            "instance_count": 8,
            "instance_type": "ml.p4d.24xlarge",
            "distribution": {"pytorchddp": {"enabled": "true"}},
        }
    )
    assert result.data["name"] == "pytorch-dataparallel-mnist"
    assert result.data["launcher"] == "torchrun"
    assert result.data["command"] == ["python3", "code/my_model.py"]
    assert result.spec.job.world_size == 64


def test_seed_003_lightning_smddp_on_p3_says_smddp_does_not_support_it():
    result = imported(
        {
            "entry_point": "lightning_train.py",
            "instance_count": 8,
            "instance_type": "ml.p3.16xlarge",
            "distribution": {"smdistributed": {"dataparallel": {"enabled": True}}},
            "max_run": 3 * 3600 + 1,
            "max_retry_attempts": 2,
        }
    )
    assert result.data["collectives"] == {"backend": "smddp", "smddp_fallback": True}
    assert result.data["compat"] == ["smddp"]
    assert result.data["time_limit"] == "03:01:00"  # rounded up to whole minutes
    assert result.data["resilience"] == {"max_restarts": 2}
    lines = [w.line() for w in result.warnings if w.field == "instance_type"]
    assert any("SMDDP supports only ml.p4d.24xlarge, ml.p4de.24xlarge" in line for line in lines)
    assert any("runs as hpkit's NCCL alias" in line for line in lines)


def test_mpi_options_and_unknown_distributions_are_warned_not_dropped():
    result = imported(
        {
            "entry_point": "hvd.py",
            "instance_count": 2,
            "instance_type": "ml.g5.48xlarge",
            "distribution": {
                "mpi": {
                    "enabled": True,
                    "processes_per_host": 8,
                    "custom_mpi_options": "-x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH --bind-to none -mca pml ob1",
                },
                "parameter_server": {"enabled": True},
            },
        }
    )
    assert result.data["env"] == {"NCCL_DEBUG": "INFO", "OMPI_MCA_pml": "ob1"}
    assert result.data["gpus_per_node"] == 8
    lines = warned(result)
    assert "'--bind-to none'" in lines["distribution.mpi.custom_mpi_options"]
    assert "distribution.parameter_server" in lines


def _smp_estimator(parameters: dict) -> dict:
    smp = {"modelparallel": {"enabled": True, "parameters": parameters}}
    return {
        "entry_point": "a.py",
        "instance_type": "ml.p4d.24xlarge",
        # SMP v1 is launched by mpi (torch_distributed + modelparallel is SMP v2: test_compat_smp_v2.py).
        "distribution": {"mpi": {"enabled": True}, "smdistributed": smp},
    }


@pytest.mark.parametrize(
    ("estimator", "words"),
    [
        (
            {"instance_type": "ml.p4d.24xlarge"},
            "est.yaml: entry_point: missing: copy it from the estimator's arguments",
        ),
        ({"entry_point": "a.py", "instance_type": "x", "instance_count": 0}, "est.yaml: instance_count:"),
        (
            {"entry_point": "a.py", "instance_type": "x", "distribution": {"mpi": {"enabled": "yes"}}},
            "est.yaml: distribution.mpi.enabled: expected true or false",
        ),
        (
            _smp_estimator({"tensor_parallel_degree": 3}),
            "parallelism",
        ),
        (
            _smp_estimator({"tensor_parallel_degree": 0}),
            # The reason itself, not pydantic's trailing "For further information visit ..." line.
            "est.yaml: distribution.smdistributed.modelparallel.parameters: tp=0: a degree is a positive integer",
        ),
    ],
)
def test_bad_estimators_are_one_line_per_problem_naming_the_field(estimator, words):
    with pytest.raises(SpecError) as err:
        imported(estimator)
    assert words in str(err.value)
    assert "Traceback" not in str(err.value)


def test_cli_writes_a_spec_that_loads_and_prints_the_warnings(tmp_path, repo):
    est = tmp_path / "est.json"
    est.write_text(json.dumps({**SEED_000, "distribution": {"mpi": SMP_MPI}}))
    out = tmp_path / "job.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "import-sagemaker", str(est), "-o", str(out), "--name", "moved"],
        capture_output=True,
        text=True,
        cwd=repo,
        env={"PYTHONPATH": str(repo / "python"), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "warning: role: SageMaker-only option" in proc.stderr
    text = out.read_text()
    assert "#   - role: SageMaker-only option" in text
    spec = load_document(JobSpec, out)
    assert (spec.job.name, spec.job.launcher, spec.job.ranks_per_node) == ("moved", "mpi", 8)
    assert yaml.safe_load(text)["instance_type"] == "ml.p3.16xlarge"

    bad = tmp_path / "bad.json"
    bad.write_text('{"entry_point": ')
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "import-sagemaker", str(bad)],
        capture_output=True,
        text=True,
        cwd=repo,
        env={"PYTHONPATH": str(repo / "python"), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("hpkit import-sagemaker: error: ") and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
