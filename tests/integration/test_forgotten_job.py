"""`hpkit status JOB` and `hpkit plot JOB` after the controller has forgotten the job (MinJobAge passed):
the note `hpkit submit` left leads to the training files.

A private cluster with MinJobAge=2: slurmctld purges ended jobs on its own schedule (below a MinJobAge of 60,
every max(10, MinJobAge) s, as measured here), and the test waits for that event (`scontrol show job` no longer knows the id), not a fixed time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_resilience import TINY_MODEL
from test_slurm_jobs import hpkit, submit

from _clusters import slot
from hpkit import devcluster

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

PORT, FIRST_JOB_ID = slot("forgotten")
STEPS = 6


def _known_to_controller(job_id: str, env: dict[str, str]) -> bool:
    proc = subprocess.run(
        ["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30
    )
    return proc.returncode == 0


def _training(job_id: str, cwd, env: dict[str, str]) -> dict | None:
    proc = hpkit("status", job_id, "--json", cwd=cwd, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    got = json.loads(proc.stdout)
    assert got["state"] == "COMPLETED", got
    return got["training"]


def test_status_and_plot_find_a_forgotten_jobs_files_through_the_submit_note(tmp_path_factory):
    notes = tmp_path_factory.mktemp("notes")
    base = {**os.environ, "HPKIT_STATE_DIR": str(notes)}
    env = devcluster.client_env(
        tmp_path_factory.mktemp("forgetful-cluster"), PORT, FIRST_JOB_ID, base=base, min_job_age=2
    )
    work = tmp_path_factory.mktemp("forgotten")
    spec = {
        "name": "forgotten",
        "nodes": 1,
        "tasks_per_node": 2,
        "launcher": "torchrun",
        "output_dir": "logs",
        "command": [sys.executable, "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": 2},
        "model": TINY_MODEL,
        "train": {"steps": STEPS, "local_batch_size": 2, "mixed_precision": "fp32", "tensorboard": False},
        "checkpoint": {"dir": "ckpt-%j", "interval": 3},
    }
    with devcluster.running(env):
        job_id = submit(spec, work, env)
        waited = hpkit("wait", job_id, "--timeout", "300", cwd=work, env=env)
        assert waited.returncode == 0, waited.stderr
        deadline = time.monotonic() + 240
        while _known_to_controller(job_id, env):
            assert time.monotonic() < deadline, f"slurmctld still knows job {job_id} after 240 s"
            time.sleep(1)

        training = _training(job_id, work, env)
        assert training is not None, "the note did not lead to the training files"
        assert training["step"] == STEPS and training["total_steps"] == STEPS and training["finished"]
        assert training["checkpoint"]["step"] == STEPS

        png = work / "forgotten.png"
        plot = hpkit("plot", job_id, "-o", str(png), cwd=work, env=env)
        assert plot.returncode == 0, plot.stderr
        assert png.stat().st_size > 0

        # Without the note, nothing leads there any more: the note is what found the files.
        assert _training(job_id, work, {**env, "HPKIT_STATE_DIR": str(work / "no-notes")}) is None
        # A note for another job that got the same id (a rebuilt cluster) is not used.
        note = notes / "jobs" / f"{job_id}.json"
        record = json.loads(note.read_text())
        note.write_text(json.dumps({**record, "name": "someone-else"}))
        assert _training(job_id, work, env) is None
