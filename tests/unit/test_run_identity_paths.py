from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpkit.runtime.config import RunConfig
from hpkit.runtime.run_identity import RunIdentity, run_paths


@pytest.mark.parametrize(
    ("env", "job"),
    [
        ({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "none"}, "42"),
        ({"TORCHELASTIC_RUN_ID": "9f1c"}, "9f1c"),  # torchrun --standalone or --rdzv-id
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # plain torchrun: a placeholder, not an id
        ({}, None),
    ],
)
def test_job_id_and_the_job_pattern(env, job):
    ident = RunIdentity.from_env(env, now=0.0)
    assert ident.job_id == job
    assert ident.expand("/fsx/ckpt/run-%j") == f"/fsx/ckpt/run-{job or 'local'}"
    assert ident.expand("/plain") == "/plain"
    # Without a job id the run is named by its start time: a fresh metrics file per launch.
    assert ident.run_id == (job or time.strftime("%Y%m%d-%H%M%S", time.localtime(0.0)))


def test_inside_and_outside_the_job_name_the_same_files(tmp_path):
    """`hpkit train` inside Slurm job 42 and `hpkit status 42` outside it, from the job's working directory."""
    cfg = RunConfig.model_validate(
        {"name": "llama", "output_dir": "logs", "checkpoint": {"dir": "ckpt/%j"}, "model": {"name": "debug"}}
    )
    inside = run_paths(cfg, RunIdentity.from_env({"SLURM_JOB_ID": "42"}))
    outside = run_paths(cfg, RunIdentity.of_job("42"), workdir=tmp_path)
    assert inside.metrics_file == Path("logs/llama-42.metrics.jsonl")
    assert inside.checkpoint_dir == Path("ckpt/42") and inside.tensorboard_dir == Path(
        "logs/tensorboard/llama-42"
    )
    assert outside.metrics_file == tmp_path / inside.metrics_file
    assert outside.checkpoint_dir == tmp_path / inside.checkpoint_dir
