"""sagemaker_env in rendered scripts: the SM_* variables each task sees, hostile paths kept literal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

# Stands in for srun outside a cluster: runs the task wrapper once per "node", as two tasks would.
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
for node in node1 node2; do SLURMD_NODENAME=$node SLURM_CPUS_ON_NODE=4 "$@"; done
"""
FAKE_SCONTROL = """#!/bin/sh
case "$2" in hostnames) echo node1; echo node2;; node) echo "NodeName=node1 NodeAddr=10.0.0.1 Port=0";; esac
"""
RECORD = (
    "import json, os, sys; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('SM_')}))"
)


@pytest.mark.parametrize("launcher", ["torchrun", "srun", "mpi"])
def test_each_task_sees_sagemaker_variables(tmp_path, launcher):
    canary = tmp_path / "canary"
    hostile = f"data/$(touch {canary}) 'x'"
    spec = parse_document(
        JobSpec,
        {
            "name": "sm",
            "nodes": 2,
            "gpus_per_node": 4,
            "launcher": launcher,
            "output_dir": "out",
            "command": ["python3", "-c", RECORD],
            "sagemaker_env": {"channels": {"training": "/fsx/train", "eval": hostile}},
        },
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # torchrun is not what is under test here: a stand-in that runs the command after `--`.
    for name in ("torchrun", "hpkit-torchrun"):
        (bin_dir / name).write_text('#!/bin/bash\nwhile [[ $1 != -- ]]; do shift; done\nshift\nexec "$@"\n')
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec))
    # The job's supervisor (python3 -m hpkit.supervise) runs from this environment, as hpkit submit arranges.
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {"PATH": path, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]"}
    env["SLURM_CPUS_ON_NODE"] = "4"
    proc = subprocess.run(
        ["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    seen = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [s["SM_CURRENT_HOST"] for s in seen] == ["node1", "node2"]
    for s in seen:
        assert json.loads(s["SM_HOSTS"]) == ["node1", "node2"]
        assert s["SM_NUM_GPUS"] == "4" and s["SM_NUM_CPUS"] == "4"
        assert s["SM_MODEL_DIR"] == f"{tmp_path}/out/model"
        assert s["SM_OUTPUT_DATA_DIR"] == f"{tmp_path}/out/output"
        assert json.loads(s["SM_CHANNELS"]) == ["eval", "training"]
        assert s["SM_CHANNEL_TRAINING"] == "/fsx/train"
        assert s["SM_CHANNEL_EVAL"] == f"{tmp_path}/{hostile}"
    assert (tmp_path / "out" / "model").is_dir()
    assert not canary.exists()


@pytest.mark.parametrize(
    ("sm", "words"),
    [
        ({"channels": {"my-data": "/d"}}, "sagemaker_env.channels: channel 'my-data': use letters"),
        ({"channels": {"train": "/a", "TRAIN": "/b"}}, "differ only in case"),
        ({"channels": {"train": " "}}, "give the path"),
        ({"model_dir": "a\nb"}, "sagemaker_env.model_dir: a directory path must not contain control"),
        ({"chanels": {}}, "did you mean 'channels'"),
    ],
)
def test_bad_sagemaker_env_names_its_field(sm, words):
    with pytest.raises(SpecError) as err:
        parse_document(JobSpec, {"name": "x", "sagemaker_env": sm}, "job.yaml")
    assert words in str(err.value)
    assert len(str(err.value).splitlines()) == 1
