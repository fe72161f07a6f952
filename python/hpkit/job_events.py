"""A training job's own files beside its log: the events file, the runs file and the restart budget.

`hpkit.supervise` (the batch script's supervisor) writes them; `hpkit why` reads them. They live in the job's
output folder (where `#SBATCH --output` puts the log), named by the job id, so that every run of a requeued
job, on whichever batch host, finds the same ones:

- `.hpkit-<job>.events.jsonl`: one JSON object a line, appended: what the supervisor saw and did. Every event
  has `type`, `time` (Unix seconds), `job`, `restart` (Slurm's restart count of the run) and `attempt` (the
  step's attempt inside the run); the other fields are the type's (see the constants below).
- `.hpkit-<job>.runs`: `nodes LIST` for the current run, `requeued-by-hpkit K` when hpkit requeued the job.
- `.hpkit-<job>.budget.json`: the one restart budget, across requeues and restarts inside the allocation.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# Event types.
RUN_STARTED = (
    "run_started"  # nodes, batch_host, max_restarts, budget_left, launcher, hangs_dir, logs, requeued_by
)
USR1 = "usr1"  # Slurm's warning signal reached the supervisor
STEP_STARTED = "step_started"  # nodes, spares, logs (each log file's size then)
STEP_ENDED = "step_ended"  # exit, signalled, tasks (srun's per-task errors: node, tasks, outcome, exit_code)
PROBE = "probe"  # nodes asked; unanswering (srun), down (sinfo) or all_answer (one srun over all)
SPARE_SWAP = "spare_swap"  # node, spare, spares_left
REPLACE_ASKED = (
    "replace_asked"  # node, ok (HyperPod: scontrol update node=X state=fail reason=Action:Replace)
)
RESTART = "restart"  # reason (hang | node), verdict, nodes, budget_left: the step restarts in the allocation
REQUEUE = "requeue"  # reason (usr1 | no_spare), to_restart, max_restarts, budget_left
REQUEUE_OFF = "requeue_off"  # ok: Slurm's own requeue turned off (budget spent, or only hpkit's was meant)
NODE_LOST = "node_lost"  # nodes, exit, then (requeued | ended): a step ended with nodes gone, no spares
WATCH_STORE = "watch_store"  # address, node; or error
END = "end"  # outcome, exit, budget_left, max_restarts, verdict

# END outcomes.
COMPLETED = "completed"
PROGRAM_FAILED = "program_failed"  # the step failed with every node answering and no hang
HANG_BUDGET_SPENT = "hang_budget_spent"  # the step hung and no restart is left
BUDGET_SPENT = "budget_spent"  # a restart was needed and none is left
REQUEUED = "requeued"
NODE_LOST_UNHANDLED = "node_lost_unhandled"  # Slurm did not act on a lost node in time
SIGNALLED = "signalled"  # the step ended after USR1 and no requeue is left


ARRAY_JOB_VAR, ARRAY_TASK_VAR = "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"


def task_name(array_job: str, task: str | int) -> str:
    """Slurm's name for a task of a job array (`squeue`, `scontrol`, `sacct` take it): JOB_TASK."""
    return f"{array_job}_{task}"


def job_key(env: Mapping[str, str]) -> str | None:
    """The job as its files are named: JOB_TASK in a job array (each task's SLURM_JOB_ID is its own number, but
    users know a task by the array's), else SLURM_JOB_ID; None outside Slurm."""
    array, task = env.get(ARRAY_JOB_VAR), env.get(ARRAY_TASK_VAR)
    if array and task:
        return task_name(array, task)
    return env.get("SLURM_JOB_ID") or None


def _named(folder: Path, job_id: str, suffix: str) -> Path:
    return folder / f".hpkit-{job_id}.{suffix}"


def events_path(folder: Path, job_id: str) -> Path:
    return _named(folder, job_id, "events.jsonl")


def runs_path(folder: Path, job_id: str) -> Path:
    return _named(folder, job_id, "runs")


def budget_path(folder: Path, job_id: str) -> Path:
    return _named(folder, job_id, "budget.json")


def append(path: Path, event: dict[str, Any]) -> None:
    """One line, in one write (O_APPEND): a reader never sees half an event."""
    line = json.dumps({"time": round(time.time(), 3), **event}, sort_keys=False) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(lines: Iterator[str] | list[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, the line, the event) for each well-formed event; a torn or foreign line is skipped."""
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("type"), str):
            yield number, line, event


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` with `data` as JSON: written to a temporary file beside it, then renamed."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
