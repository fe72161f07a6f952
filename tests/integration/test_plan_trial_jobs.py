"""`hpkit plan job.yaml --trial 2` on the session's 2-node cluster (slot "session", tests/_clusters.py): the search
over a tiny model's 2-rank layouts, its top two submitted through `hpkit submit`'s path as 2-node jobs of a few
steps, measured from their metrics files and re-ranked by the measurement.

One plan run, two short torchrun jobs side by side (each takes one CPU of each node); then a second run that is
interrupted (SIGINT, as Ctrl-C) once it has submitted its two jobs, which must cancel them. The pure parts (the
trial's spec, the median, the verdicts, the table) are tests/unit/test_plan_trial.py.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_resilience import TINY_MODEL
from test_slurm_jobs import hpkit

from hpkit.slurm import CliBackend, JobState, wait

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

STEPS = 5
WARMUP = 2  # hpkit.plan.trial.WARMUP_STEPS


def test_plan_trial_runs_the_top_two_and_reranks_them_by_measurement(slurm_cluster, tmp_path: Path) -> None:
    spec = {
        "name": "plantiny",
        "nodes": 2,
        "tasks_per_node": 1,
        "launcher": "torchrun",
        "time_limit": "5",
        "output_dir": "logs",
        "command": [sys.executable, "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": 2},
        "model": TINY_MODEL,
        "train": {"steps": 500, "local_batch_size": 2, "mixed_precision": "fp32", "tensorboard": False},
        # The real run's checkpoints: a trial must not write there (nor resume from them).
        "checkpoint": {"dir": "ckpt-%j", "interval": 1},
    }
    path = tmp_path / "plantiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    args = ["plan", str(path), "--instance", "p5.48xlarge", "--trial", "2", "--trial-steps", str(STEPS)]
    proc = hpkit(*args, "--json", "--top", "4", "--poll", "0.5", cwd=tmp_path, env=slurm_cluster, timeout=240)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["world"] == 2 and doc["global_batch"] == 4
    trials = doc["trials"]
    # The search's top two ran, each as its own job.
    assert sorted(t["predicted_rank"] for t in trials) == [1, 2]
    assert {t["layout"] for t in trials} == {c["layout"] for c in doc["ranked"][:2]}
    assert len({t["job_id"] for t in trials}) == 2
    for t in trials:
        assert t["state"] == "COMPLETED" and t["problem"] is None, t
        assert t["measured_tokens_per_s_per_gpu"] > 0 and t["measured_steps"] == STEPS - WARMUP
        assert t["memory_kind"] == "max_rss" and t["measured_peak_gib"] > 0
        # What the table says is what the job's own metrics file holds: the median after the warm-up, per rank.
        metrics = tmp_path / "logs" / f"{t['name']}-{t['job_id']}.metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        tps = [r["tokens_per_s"] for r in records if "event" not in r]
        assert len(tps) == STEPS
        assert t["measured_tokens_per_s_per_gpu"] == pytest.approx(
            statistics.median(tps[WARMUP:]) / 2, rel=1e-3
        )
        # The job ran the layout it stands for, under the base's job fields.
        [snapshot] = (tmp_path / "logs").glob(f"{t['name']}-2*.yaml")
        ran = yaml.safe_load(snapshot.read_text())
        layout = next(c for c in doc["ranked"] if c["layout"] == t["layout"])
        assert {k: ran["parallelism"][k] for k in layout["parallelism"]} == layout["parallelism"]
        assert (
            ran["time_limit"] == "5" and ran["train"]["steps"] == STEPS and ran["checkpoint"]["dir"] is None
        )
    assert not list(tmp_path.glob("ckpt-*")), "a trial wrote checkpoints where the real run keeps them"
    # Re-ranked by the measurement: fastest measured first.
    measured = [t["measured_tokens_per_s_per_gpu"] for t in trials]
    assert measured == sorted(measured, reverse=True)

    # Ctrl-C once both trials are submitted (the event: their lines on stderr) cancels them.
    again = subprocess.Popen(
        [sys.executable, "-m", "hpkit", *args, "--poll", "0.5"],
        cwd=tmp_path,
        env=slurm_cluster,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interactive_sigint,
    )
    try:
        jobs: list[str] = []
        deadline = time.monotonic() + 60
        while len(jobs) < 2 and time.monotonic() < deadline:
            line = again.stderr.readline()
            if not line:
                break
            jobs += re.findall(r"^hpkit plan: trial #\d .*: job (\d+),", line)
        assert len(jobs) == 2, again.stderr.read()
        again.send_signal(signal.SIGINT)
        _, err = again.communicate(timeout=60)
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    assert again.returncode == 130, err
    assert f"cancelled the trial jobs {jobs[0]}, {jobs[1]}" in err
    for job_id in jobs:
        assert wait(CliBackend(), job_id, poll_s=0.5, timeout_s=60).state == JobState.CANCELLED


def _interactive_sigint() -> None:
    """The command starts with SIGINT as a terminal's shell leaves it: delivered, and not ignored. An ignored or
    blocked SIGINT is inherited across exec, and Python then installs no KeyboardInterrupt handler; a fresh-clone
    `make test` once saw this command ride out the Ctrl-C to exit 0 on an xdist worker (alone, the test passes),
    so the worker's own signal state is not the command's to inherit."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
