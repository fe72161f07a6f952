"""`hpkit status JOB`, `hpkit wait JOB --follow` and `hpkit plot JOB` on a real training job on the local cluster.

The job is submitted from a folder whose name has a space, so that finding its files (scontrol's Command and
WorkDir, the script's HPKIT_SPEC) is tested on such paths.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resilience import TINY_MODEL
from test_slurm_jobs import hpkit, submit
from test_slurm_polling import calls, counting_path

from hpkit.jobs.watch import JobWatcher
from hpkit.slurm import CliBackend, JobState, wait

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

STEPS = 120


def step_records(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if "event" not in r}


def test_status_follow_and_plot_of_a_training_job(slurm_cluster, tmp_path):
    workdir = tmp_path / "run dir"
    workdir.mkdir()
    spec = {
        "name": "watched",
        "nodes": 2,
        "tasks_per_node": 1,
        "launcher": "torchrun",
        "output_dir": "logs",  # relative: from the job's working directory
        "command": [sys.executable, "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": 2},
        "model": TINY_MODEL,
        "train": {
            "steps": STEPS,
            "local_batch_size": 2,
            "lr": 0.01,
            "mixed_precision": "fp32",
            "tensorboard": False,
        },
        "checkpoint": {"dir": "ckpt-%j", "interval": 25, "keep": 2},
    }
    job_id = submit(spec, workdir, slurm_cluster)
    # The follower's Slurm calls are logged: its training progress comes from the files that squeue's record
    # locates, with no scontrol call per poll.
    extra, follow_log = counting_path(tmp_path)
    follower = subprocess.Popen(
        [sys.executable, "-m", "hpkit", "wait", job_id, "--follow", "--poll", "0.3", "--timeout", "300"],
        cwd=workdir,
        env={**slurm_cluster, **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Mid-run: wait for the first step record to appear (the event), then take one status.
    watcher = JobWatcher(CliBackend(), job_id)
    deadline = time.monotonic() + 240
    mid = None
    while time.monotonic() < deadline:
        info, prog = watcher.poll()
        if prog is not None and prog.step:
            mid = (info, prog)
            break
        assert not info.state.finished, f"job ended before any step was seen: {info.summary()}"
        time.sleep(0.2)
    assert mid is not None, "no step record within 240 s"
    info, prog = mid
    assert info.state == JobState.RUNNING and prog.total_steps == STEPS and prog.step > 0

    final = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=300)
    out, err = follower.communicate(timeout=60)
    assert final.state == JobState.COMPLETED, (final, err)
    metrics = workdir / "logs" / f"watched-{job_id}.metrics.jsonl"
    records = step_records(metrics)
    assert sorted(records) == list(range(1, STEPS + 1))
    # What status saw mid-run is the file's record for that step.
    assert prog.loss == pytest.approx(records[prog.step]["loss"], abs=0)

    assert {n for _, n in calls(follow_log)} == {"squeue"}, follow_log.read_text()

    # After the end: the last record, the newest committed checkpoint on disk, no restarts; one Slurm call
    # (squeue's record names the script and working directory that locate the training files).
    follow_log.write_text("")
    status = hpkit("status", job_id, "--json", cwd=tmp_path, env={**slurm_cluster, **extra})
    assert status.returncode == 0, status.stderr
    assert [n for _, n in calls(follow_log)] == ["squeue"], follow_log.read_text()
    got = json.loads(status.stdout)
    assert got["state"] == "COMPLETED"
    training = got["training"]
    assert training["step"] == STEPS and training["total_steps"] == STEPS
    assert training["loss"] == records[STEPS]["loss"]
    committed = sorted(
        int(p.name[5:]) for p in (workdir / f"ckpt-{job_id}").glob("step-*") if p.name[5:].isdigit()
    )
    assert committed == [100, STEPS]  # keep: 2; the final save at 120
    assert training["checkpoint"]["step"] == STEPS and training["restarts"] == 0 and training["finished"]
    line = hpkit("status", job_id, cwd=tmp_path, env=slurm_cluster).stdout.strip()
    assert line.startswith(f"job {job_id} (watched): COMPLETED")
    assert f"| step {STEPS}/{STEPS} (100%) | loss {records[STEPS]['loss']:.4f} |" in line
    assert f"| ckpt step {STEPS} (" in line and line.endswith("| restarts 0")

    # --follow without a terminal: one line per change, steps never go back, the last line is the end.
    assert follower.returncode == 0, err
    lines = out.strip().splitlines()
    assert all(x.startswith(f"job {job_id} (watched): ") for x in lines), out
    steps = [int(m.group(1)) for x in lines if (m := re.search(r"\| step (\d+)/", x))]
    assert steps and steps == sorted(steps) and steps[-1] == STEPS, out
    assert len(lines) == len(set(lines)), "a line is printed only when something changed"
    assert "COMPLETED" in lines[-1] and "done" in lines[-1]

    # The job id plots: the curves hold the file's losses.
    png = tmp_path / "watched.png"
    proc = hpkit("plot", job_id, "-o", str(png), "--size", "500x400", cwd=tmp_path, env=slurm_cluster)
    assert proc.returncode == 0, proc.stderr
    from matplotlib.image import imread

    assert imread(png).shape[:2] == (400, 500)


def test_a_job_that_is_not_hpkit_training_shows_only_its_slurm_state(slurm_cluster, tmp_path):
    spec = {"name": "plain", "launcher": "srun", "command": ["bash", "-c", "exit 0"]}
    job_id = submit(spec, tmp_path, slurm_cluster)
    wait(CliBackend(), job_id, poll_s=0.3, timeout_s=120)
    got = json.loads(hpkit("status", job_id, "--json", cwd=tmp_path, env=slurm_cluster).stdout)
    assert got["state"] == "COMPLETED" and got["training"] is None
    line = hpkit("status", job_id, cwd=tmp_path, env=slurm_cluster).stdout.strip()
    assert line == CliBackend().info(job_id).summary()
    follow = hpkit("wait", job_id, "--follow", cwd=tmp_path, env=slurm_cluster)
    assert follow.returncode == 0 and follow.stdout.strip() == line
    # On a terminal the line is rewritten in place (carriage return, erase line) and ends with a newline.
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpkit", "wait", job_id, "--follow"],
        cwd=tmp_path,
        env=slurm_cluster,
        stdout=child,
        stderr=subprocess.PIPE,
    )
    os.close(child)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    seen = b""
    while chunk := _read_pty(main):
        seen += chunk
    os.close(main)
    assert seen == b"\r\x1b[K" + line.encode() + b"\r\n"  # the terminal turns \n into \r\n


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the writer has closed its side
        return b""
