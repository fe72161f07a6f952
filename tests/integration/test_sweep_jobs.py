"""A sweep (`hpkit submit --sweep-file`) is one Slurm job array on the real local cluster: each task trains with its
own overrides into its own metrics, checkpoints and events, and one task that fails at start shows as FAILED in
the array's table (`hpkit status ARRAY`, `hpkit why ARRAY`) beside the others, which complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_resilience import TINY_MODEL, losses, wait_for

from hpkit import job_events as ev

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

TASKS = [
    {"train.lr": 0.001, "train.seed": 1},
    {"train.lr": 0.05, "train.seed": 1},
    {"train.lr": 0.001, "train.seed": 2},
    # Valid for the spec, but the token file is not there: the training raises at start.
    {"train.lr": 0.05, "train.data": {"kind": "tokens", "path": "/nonexistent/hpkit-sweep-tokens.bin"}},
]


def hpkit(*args: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slurm_24_11
def test_a_sweep_runs_as_one_job_array_each_task_with_its_overrides(slurm_cluster, tmp_path):
    spec = {
        "name": "sweep",
        "nodes": 1,
        "tasks_per_node": 1,
        "launcher": "torchrun",
        "output_dir": str(tmp_path / "logs"),
        "command": [sys.executable, "-m", "hpkit", "train"],
        "model": TINY_MODEL,
        "train": {
            "steps": 6,
            "local_batch_size": 2,
            "mixed_precision": "fp32",
            "tensorboard": False,
            "metrics_file": str(tmp_path / "sweep.jsonl"),
        },
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 3, "keep": 1},
        "resilience": {"max_restarts": 0},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(TASKS))
    env = slurm_cluster
    submitted = hpkit("submit", "job.yaml", "--sweep-file", "sweep.yaml", cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.split("submitted job ")[1].split()[0]
    script = Path(submitted.stdout.split("script: ")[1].split()[0]).read_text()
    assert "#SBATCH --array=0-3\n" in script  # one job, four tasks
    ids = [f"{array}_{i}" for i in range(4)]

    # The array's id stands for all its tasks.
    waited = hpkit("wait", array, "--poll", "0.5", "--timeout", "240", cwd=tmp_path, env=env, timeout=300)
    assert waited.returncode != 0, waited.stdout + waited.stderr  # task 3 failed
    assert all(f"job {task} (sweep)" in waited.stderr for task in ids), waited.stderr

    # Each task's metrics carry its overrides, and the learning rate shows in its losses.
    runs = {}
    for i in range(3):
        path = tmp_path / f"sweep.task{i}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        start = next(r for r in records if r.get("event") == "start")
        assert start["overrides"] == TASKS[i], start
        assert [r["lr"] for r in records if "lr" in r and "event" not in r][-1] == pytest.approx(
            TASKS[i]["train.lr"]
        )
        runs[i] = losses(path)
        assert sorted(runs[i]) == list(range(1, 7)), runs[i]
        # Its own checkpoints and its own supervisor events, named by the task.
        assert (tmp_path / "ckpt" / f"task{i}").is_dir()
        events = [
            e for _, _, e in ev.read(ev.events_path(tmp_path / "logs", ids[i]).read_text().splitlines())
        ]
        assert events[-1]["type"] == "end" and events[-1]["outcome"] == "completed", events
        assert {e["job"] for e in events} == {ids[i]}
    assert runs[0][6] != pytest.approx(runs[1][6], rel=1e-3)  # same seed, other lr
    assert runs[0][1] != pytest.approx(runs[2][1], rel=1e-6)  # same lr, other seed

    # The array's table: every task, its overrides, state and final loss; the failed one does not hide the rest.
    status = hpkit("status", array, "--json", cwd=tmp_path, env=env)
    assert status.returncode == 0, status.stderr
    rows = {r["task"]: r for r in json.loads(status.stdout)}
    assert list(rows) == ids
    for i in range(3):
        assert rows[ids[i]]["state"] == "COMPLETED", rows
        assert rows[ids[i]]["overrides"] == TASKS[i]
        assert rows[ids[i]]["loss"] == pytest.approx(runs[i][6])
    assert rows[ids[3]]["state"] == "FAILED" and rows[ids[3]]["loss"] is None, rows
    table = hpkit("status", array, cwd=tmp_path, env=env).stdout
    assert "train.lr=0.05" in table and "FAILED" in table and table.count("COMPLETED") == 3, table

    # One task, as any job: its own status line and its own verdict.
    one = hpkit("status", ids[1], cwd=tmp_path, env=env)
    assert one.stdout.startswith(f"job {ids[1]} (sweep): COMPLETED"), one.stdout + one.stderr
    assert "step 6/6" in one.stdout and f"loss {runs[1][6]:.4f}" in one.stdout, one.stdout
    why = hpkit("why", ids[3], cwd=tmp_path, env=env)
    assert why.returncode == 0, why.stderr
    assert why.stdout.startswith("program error") and f"sweep-{ids[3]}.out" in why.stdout, why.stdout
    whole = hpkit("why", array, cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr
    lines = whole.stdout.splitlines()
    assert len(lines) == 5 and "WHY" in lines[0] and ids[3] in lines[4], whole.stdout


def test_a_preempted_array_task_requeues_and_resumes_alone(slurm_cluster, tmp_path):
    """Slurm's warning signal to one task: that task checkpoints, requeues (its own budget and events) and resumes
    from its own checkpoints with its overrides; its sibling runs once, untouched."""
    env = slurm_cluster
    spec = {
        "name": "requeue",
        "nodes": 1,
        "tasks_per_node": 1,
        "launcher": "torchrun",
        "output_dir": str(tmp_path / "logs"),
        "command": [sys.executable, "-m", "hpkit", "train"],
        "model": TINY_MODEL,
        # Every save of the first run takes a second longer: the signal comes while the task still trains.
        "env": {"HPKIT_FAULT": "slow_save:seconds=1"},
        "train": {"steps": 12, "local_batch_size": 2, "mixed_precision": "fp32", "tensorboard": False},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 1, "keep": 1},
        "resilience": {"max_restarts": 1, "signal_grace_s": 30},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    submitted = hpkit("submit", "job.yaml", "--sweep", "train.lr=0.001,0.05", cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.split("submitted job ")[1].split()[0]
    ids = [f"{array}_0", f"{array}_1"]
    metrics = [tmp_path / "logs" / f"requeue-{i}.metrics.jsonl" for i in ids]
    wait_for(lambda: len(losses(metrics[1])) >= 2, 180, "task 1's first steps")
    subprocess.run(["scancel", "--batch", "--signal=USR1", ids[1]], env=env, check=True, timeout=30)
    waited = hpkit("wait", *ids, "--poll", "0.5", "--timeout", "400", cwd=tmp_path, env=env, timeout=450)
    assert waited.returncode == 0, waited.stdout + waited.stderr

    def events(task: str) -> list[dict]:
        return [e for _, _, e in ev.read(ev.events_path(tmp_path / "logs", task).read_text().splitlines())]

    requeued, untouched = events(ids[1]), events(ids[0])
    assert [e["reason"] for e in requeued if e["type"] == "requeue"] == ["usr1"], requeued
    assert [e["restart"] for e in requeued if e["type"] == "run_started"] == [0, 1], requeued
    assert requeued[-1]["outcome"] == "completed"
    assert [e["type"] for e in untouched if e["type"] in ("requeue", "run_started")] == ["run_started"], (
        untouched
    )
    starts = [json.loads(line) for line in metrics[1].read_text().splitlines() if '"event": "start"' in line]
    assert len(starts) == 2 and all(s["overrides"] == {"train.lr": 0.05} for s in starts), starts
    assert starts[1]["resumed_from"].startswith(str(tmp_path / "ckpt" / "task1")), starts
    assert sorted(losses(metrics[1])) == list(range(1, 13))
