"""The example MoE job (slurm/jobs/moe.yaml) through `hpkit submit` on the real local cluster: 2 nodes x 2
ranks, ep 2 x dp_shard 2. Its losses must equal one process training the same spec on the same global
batch, and its metrics carry the MoE figures."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import _torchrun
import pytest
import yaml
from test_slurm_jobs import output_of, submit

from hpkit.slurm import CliBackend, JobState, wait

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

# The example's layout and MoE shape with a model small enough for 4 ranks on 2 CPUs.
SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 64, "vocab_size": 256, "seq_len": 32}


def _steps(path: Path) -> dict[int, dict]:
    records = (json.loads(line) for line in path.read_text().splitlines())
    return {r["step"]: r for r in records if "event" not in r}


def test_the_example_moe_job_trains_like_one_process(slurm_cluster, tmp_path, repo):
    spec = yaml.safe_load((repo / "slurm/jobs/moe.yaml").read_text())
    assert spec["parallelism"] == {"dp_shard": 2, "ep": 2} and spec["model"]["name"] == "debug-moe"
    spec["model"].update(SMALL)
    spec["command"] = [sys.executable, "-m", "hpkit", "train"]
    spec["output_dir"] = str(tmp_path / "logs")
    spec["train"].update(steps=4, log_every=1, tensorboard=False, metrics_file=str(tmp_path / "job.jsonl"))
    spec["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "interval": 4, "keep": 1}
    job_id = submit(spec, tmp_path, slurm_cluster)

    # Meanwhile, one process on the same global batch (4 data-parallel slices of local_batch_size).
    single = json.loads(json.dumps(spec))
    single.update(name="moe-single", nodes=1, tasks_per_node=1)
    single["parallelism"] = {"dp_shard": 1}
    single["train"].update(local_batch_size=4 * spec["train"]["local_batch_size"])
    single["train"]["metrics_file"] = str(tmp_path / "single.jsonl")
    single["checkpoint"]["dir"] = str(tmp_path / "ckpt-single")
    (tmp_path / "single.yaml").write_text(yaml.safe_dump(single))
    _torchrun.run(["-m", "hpkit", "train", "--config", str(tmp_path / "single.yaml")], tmp_path / "tmp", None)

    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=300)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    summary = re.search(r"hpkit train: done .* world=(\d+) layout=(\S+)", log)
    assert summary and summary.groups() == ("4", "dp_shard:2,ep:2"), log
    job, reference = _steps(tmp_path / "job.jsonl"), _steps(tmp_path / "single.jsonl")
    assert sorted(job) == [1, 2, 3, 4]
    for step in job:
        for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
            assert job[step][key] == pytest.approx(reference[step][key], rel=1e-5), (step, key)
    assert len({r["loss"] for r in job.values()}) > 1
