"""SMDDP scripts from the seeds on the real local cluster, through `hpkit import-sagemaker` + `hpkit submit`.

The estimator says smdistributed.dataparallel; the importer turns on `compat: [smddp]`, and the scripts'
`import smdistributed.dataparallel.torch.torch_smddp` + backend "smddp" run on hpkit's alias (gloo here)
over 2 nodes x 2 ranks. Every rank writes a digest of its weights before and after training
(sagemaker_scripts/weights.py): the replicas must agree, and training must have changed them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml
from test_slurm_jobs import hpkit, output_of, submit, unlabelled

from hpkit.slurm import CliBackend, JobState, wait

pytestmark = pytest.mark.cluster

SCRIPTS = Path(__file__).resolve().parent / "sagemaker_scripts"
ALIAS_LINE = (
    "smdistributed.dataparallel: backend \"smddp\" is hpkit's alias of gloo, not SageMaker's SMDDP library: "
    "SMDDP is not installed here, and SMDDP supports only ml.p4d.24xlarge, ml.p4de.24xlarge, not ml.c5.2xlarge"
)


def imported_spec(tmp_path: Path, env: dict[str, str], entry_point: str, **hyperparameters) -> dict:
    """The estimator as a SageMaker user writes it down, through the real `hpkit import-sagemaker`."""
    estimator = {
        "entry_point": entry_point,
        "source_dir": str(SCRIPTS),
        "instance_count": 2,
        "instance_type": "ml.c5.2xlarge",  # a CPU type: SageMaker would run one process per host
        "distribution": {"smdistributed": {"dataparallel": {"enabled": True}}},
        "hyperparameters": hyperparameters,
    }
    (tmp_path / "estimator.json").write_text(json.dumps(estimator))
    proc = hpkit("import-sagemaker", "estimator.json", "-o", "job.yaml", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert spec["compat"] == ["smddp"] and spec["launcher"] == "torchrun"
    assert spec["collectives"] == {"backend": "smddp", "smddp_fallback": True}
    # Two edits a user of this CPU cluster makes: two ranks per node (the type has no GPUs to count),
    # and the Python that has torch.
    spec["tasks_per_node"] = 2
    spec["command"][0] = sys.executable
    return spec


def run(spec: dict, tmp_path: Path, env: dict[str, str], timeout_s: float = 300):
    job_id = submit(spec, tmp_path, env)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=timeout_s)
    return info, output_of(info)


def replicas(tmp_path: Path) -> list[dict]:
    out = tmp_path / "logs" / "output"
    return [json.loads(p.read_text()) for p in sorted(out.glob("weights-rank*.json"))]


def assert_trained_in_sync(records: list[dict], log: str) -> None:
    assert [r["rank"] for r in records] == [0, 1, 2, 3], log
    assert sorted(r["node"] for r in records) == ["node1", "node1", "node2", "node2"]
    for r in records:
        assert (r["backend"], r["world_size"]) == ("smddp", 4)
    assert len({r["after"] for r in records}) == 1, "the replicas ended with different weights"
    assert records[0]["after"] != records[0]["before"], "training did not change the weights"
    # Rank 0 says once that "smddp" is an alias, and why (the type, from the spec's instance_type).
    assert log.count("smdistributed.dataparallel:") == 1 and ALIAS_LINE in log, log


def test_seed_002_ddp_script_with_backend_smddp(slurm_cluster, tmp_path):
    spec = imported_spec(tmp_path, slurm_cluster, "ddp_smddp.py", backend="smddp", epochs=2)
    info, log = run(spec, tmp_path, slurm_cluster)
    assert info.state == JobState.COMPLETED, log
    assert_trained_in_sync(replicas(tmp_path), log)


def test_seed_003_lightning_script_with_smddp_strategy(slurm_cluster, tmp_path):
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip(
            "pytorch-lightning is not installed (pip install 'hpkit[lightning]'): the script needs it"
        )
    spec = imported_spec(tmp_path, slurm_cluster, "lightning_smddp.py", epochs=2)
    info, log = run(spec, tmp_path, slurm_cluster)
    assert info.state == JobState.COMPLETED, log
    records = replicas(tmp_path)
    assert_trained_in_sync(records, log)
    assert {r["steps"] for r in records} == {16}  # 256 samples / 4 ranks / batch 8, two epochs


def test_without_compat_the_script_cannot_import_smdistributed(slurm_cluster, tmp_path):
    spec = imported_spec(tmp_path, slurm_cluster, "ddp_smddp.py", backend="smddp")
    del spec["compat"]
    info, log = run(spec, tmp_path, slurm_cluster)
    assert info.state == JobState.FAILED, log
    assert "ModuleNotFoundError: No module named 'smdistributed'" in log
    assert replicas(tmp_path) == []


def test_a_spec_that_insists_on_real_smddp_stops_every_rank(slurm_cluster, tmp_path):
    spec = imported_spec(tmp_path, slurm_cluster, "ddp_smddp.py", backend="smddp")
    spec["collectives"]["smddp_fallback"] = False
    info, log = run(spec, tmp_path, slurm_cluster, timeout_s=120)
    assert info.state == JobState.FAILED, log
    lines = [line for line in unlabelled(log).splitlines() if line.startswith("smdistributed.dataparallel:")]
    assert lines == [
        "smdistributed.dataparallel: collectives.smddp_fallback is false, so this job needs SageMaker's SMDDP "
        "library, but SMDDP is not installed here, and SMDDP supports only ml.p4d.24xlarge, ml.p4de.24xlarge, "
        "not ml.c5.2xlarge: set collectives.smddp_fallback: true to run on hpkit's alias of gloo, or build the "
        "image with --build-arg SMDDP_WHEEL_URL=... for a type SMDDP supports"
    ], log
    # The script stopped at its import, before a process group existed: no rank got further.
    assert "host node" not in log and replicas(tmp_path) == []
