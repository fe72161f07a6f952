"""Preemption, time limits and lost ranks on the real local cluster: each ends in a resume.

The warning signal is what Slurm itself sends before a time-limit or preemption kill
(`--signal=B:USR1@grace` → the batch shell); `scancel --batch --signal=USR1` delivers exactly that.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpkit.slurm import CliBackend, JobState

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

TINY_MODEL = {
    "name": "debug",
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 4,
    "ffn_dim": 64,
    "vocab_size": 128,
    "seq_len": 16,
}


def training_spec(name: str, workdir: Path, steps: int, interval: int, launcher: str = "torchrun") -> dict:
    return {
        "name": name,
        "nodes": 2,
        "tasks_per_node": 1,
        "launcher": launcher,
        "output_dir": str(workdir / "logs"),
        "command": [sys.executable, "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": 2},
        "model": TINY_MODEL,
        "train": {
            "steps": steps,
            "local_batch_size": 2,
            "lr": 0.01,
            "mixed_precision": "fp32",
            "seed": 3,
            "metrics_file": str(workdir / f"{name}.jsonl"),
            "tensorboard": False,
        },
        "checkpoint": {"dir": str(workdir / f"{name}-ckpt"), "interval": interval, "keep": 2},
        "resilience": {"signal_grace_s": 30, "max_restarts": 1, "collective_timeout_s": 30},
    }


def submit(spec: dict, workdir: Path, env: dict[str, str]) -> str:
    path = workdir / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "submit", str(path)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("submitted job ")[1].split()[0]


def losses(path: Path) -> dict[int, float]:
    """step -> loss; a step run twice (before and after a resume) keeps its last value."""
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record:
                out[record["step"]] = record["loss"]
    return out


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def job_log(info) -> str:
    return Path(info.stdout).read_text() if info.stdout and Path(info.stdout).exists() else "(no log)"


def job_events(logs: Path, job: str) -> list[dict]:
    """The supervisor's events of the job (hpkit.job_events), in its output folder `logs`."""
    from hpkit import job_events as ev

    path = ev.events_path(logs, job)
    return [e for _, _, e in ev.read(path.read_text().splitlines())] if path.exists() else []


def events_of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_preempted_job_checkpoints_requeues_and_matches_an_uninterrupted_run(slurm_cluster, tmp_path):
    backend = CliBackend()
    steps = 120
    reference = submit(training_spec("reference", tmp_path, steps, interval=1000), tmp_path, slurm_cluster)
    preempted = submit(training_spec("preempted", tmp_path, steps, interval=1000), tmp_path, slurm_cluster)

    metrics = tmp_path / "preempted.jsonl"
    wait_for(lambda: len(losses(metrics)) >= 3, 240, "the preempted job's first steps")
    subprocess.run(["scancel", "--batch", "--signal=USR1", preempted], env=slurm_cluster, check=True)
    info = wait_for(
        lambda: (i := backend.info(preempted)).state == JobState.PENDING and i,
        120,
        "the job to requeue itself",
    )
    # The requeued job waits out the cluster's credential lifetime (cred_expire=20 in
    # slurm/dev/slurm.conf.in) and starts by itself; forcing StartTime=now races the old run's
    # cleanup and Slurm kills the new start ("Job credential revoked").
    info = wait_for(
        lambda: (i := backend.info(preempted)).state.finished and i, 300, "the resumed job to end"
    )
    log = job_log(info)
    assert info.state == JobState.COMPLETED, log
    events = job_events(tmp_path / "logs", preempted)
    assert events_of(events, "usr1") and events_of(events, "requeue")[0]["reason"] == "usr1", events
    # The requeued run tells hpkit's own requeue from Slurm's (a node failure).
    runs = events_of(events, "run_started")
    assert [(r["restart"], r["requeued_by"]) for r in runs] == [(0, None), (1, "hpkit")], runs
    assert events_of(events, "end")[-1]["outcome"] == "completed"
    # A trainer that ignored the signal would run all its steps, save the last (save_final) and
    # "resume" at the end: the stop line and a resume short of the end are what prove it stopped.
    stops = re.findall(r"hpkit train: stopping at step (\d+) on signal (\d+)", log)
    assert len(stops) == 1, log
    stopped_at, signum = int(stops[0][0]), int(stops[0][1])
    assert signum == signal.SIGUSR1, log
    assert stopped_at < steps, "the signal came too late to interrupt anything"
    resumes = [int(s) for s in re.findall(r"hpkit train: resumed from \S+ at step (\d+)", log)]
    assert resumes == [stopped_at], f"expected one resume at the stop step {stopped_at}:\n{log}"

    ref_info = wait_for(lambda: (i := backend.info(reference)).state.finished and i, 300, "the reference job")
    assert ref_info.state == JobState.COMPLETED, job_log(ref_info)
    expected, got = losses(tmp_path / "reference.jsonl"), losses(metrics)
    # Both series whole: the loop below compares the reference's steps, so a cut one would compare nothing.
    assert sorted(expected) == list(range(1, steps + 1)), sorted(expected)
    assert sorted(got) == list(range(1, steps + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), f"step {step}"


def test_a_killed_rank_ends_the_job_and_a_resubmission_resumes(slurm_cluster, tmp_path):
    backend = CliBackend()
    steps, interval = 150, 20
    spec = training_spec("killed", tmp_path, steps, interval=interval, launcher="srun")
    spec["resilience"]["max_restarts"] = 0
    job = submit(spec, tmp_path, slurm_cluster)
    metrics = tmp_path / "killed.jsonl"
    wait_for(lambda: max(losses(metrics), default=0) >= interval + 5, 240, "steps past the first checkpoint")

    pids = subprocess.run(
        ["scontrol", "listpids", job], env=slurm_cluster, capture_output=True, text=True
    ).stdout
    trainers = []
    for line in pids.splitlines()[1:]:
        pid = line.split()[0]
        cmdline = (
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if Path(f"/proc/{pid}").exists() else []
        )
        # The rank itself (python -m hpkit train), not the srun that launched it.
        if cmdline and Path(cmdline[0].decode()).name.startswith("python") and b"train" in cmdline:
            trainers.append(int(pid))
    assert trainers, pids
    killed_at = time.monotonic()
    last_step = max(losses(metrics))
    subprocess.run(["kill", "-9", str(trainers[0])], check=True)
    info = wait_for(
        lambda: (i := backend.info(job)).state.finished and i, 60, "the job to end after a lost rank"
    )
    # How soon after the kill: bench/bench_recovery.py (the event here: the job ended, not hung).
    print(f"killed rank -> job ended {time.monotonic() - killed_at:.1f} s")
    assert info.state in (JobState.FAILED, JobState.CANCELLED), job_log(info)

    latest = (tmp_path / "killed-ckpt" / "latest").read_text().strip()
    saved_step = int("".join(ch for ch in latest if ch.isdigit()))
    assert last_step - saved_step <= interval + 5  # at most the steps since the last checkpoint (+ in flight)

    again = submit(spec, tmp_path, slurm_cluster)
    info = wait_for(lambda: (i := backend.info(again)).state.finished and i, 300, "the resubmitted job")
    log = job_log(info)
    assert info.state == JobState.COMPLETED, log
    assert f"at step {saved_step}" in log
    assert max(losses(metrics)) == steps
