"""SageMaker-style jobs on the real local cluster: an SM_HOSTS script unchanged, and Lightning's SLURM detection."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml
from test_slurm_jobs import output_of, submit, unlabelled

from hpkit.slurm import CliBackend, JobState, wait

pytestmark = pytest.mark.cluster


def _records(log: str, prefix: str) -> list[dict]:
    return [
        json.loads(line[len(prefix) + 1 :])
        for line in unlabelled(log).splitlines()
        if line.startswith(prefix + " {")
    ]


def test_sm_hosts_script_runs_unchanged_as_a_two_node_job(slurm_cluster, tmp_path, repo):
    spec = yaml.safe_load((repo / "slurm/jobs/sm-hosts.yaml").read_text())
    spec["command"][0] = sys.executable
    (tmp_path / "data/train").mkdir(parents=True)
    (tmp_path / "data/train/part-0.bin").write_bytes(b"\0")
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=180)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    records = sorted(_records(log, "sm-hosts"), key=lambda r: r["host_rank"])
    assert [r["current_host"] for r in records] == ["node1", "node2"], log
    for rank, r in enumerate(records):
        assert r["hosts"] == ["node1", "node2"]
        assert (r["host_rank"], r["world_size"]) == (rank, 2)
        assert (r["backend"], r["model_type"]) == ("gloo", "custom")  # hyperparameters as arguments
        assert r["in_sync"]
        assert r["samples_seen"] == 50  # DistributedSampler gave each host half of 100
        assert r["num_gpus"] == "0"
        assert r["model_dir"] == str(tmp_path / "logs/model")
        assert r["channels"] == ["training"] and r["training_files"] == ["part-0.bin"]
    assert (tmp_path / "logs/model/model.pt").exists()


def test_lightning_detects_slurm_itself(slurm_cluster, tmp_path, repo):
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip(
            "pytorch-lightning is not installed (pip install 'hpkit[lightning]'): the example needs it"
        )
    spec = yaml.safe_load((repo / "slurm/jobs/lightning.yaml").read_text())
    spec["command"][0] = sys.executable
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=240)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    records = sorted(_records(log, "lightning"), key=lambda r: r["global_rank"])
    assert [r["global_rank"] for r in records] == [0, 1], log
    for r in records:
        assert r["cluster_environment"] == "SLURMEnvironment"
        assert r["world_size"] == 2 and r["steps"] == 4 and r["in_sync"]
        assert r["slurm_procid"] == str(r["global_rank"])
        assert r["node_rank"] == r["global_rank"] and r["local_rank"] == 0
    assert [r["node"] for r in records] == ["node1", "node2"]
