"""A sweep's job array as one table (`hpkit status ARRAY`, `hpkit why ARRAY`): each task's overrides, Slurm's
state, its training progress and final loss, and (for `why`) the first line of its verdict.

One Slurm call for every task's state; each task's metrics file is read as `hpkit status JOB_TASK` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpkit.errors import HpkitError
from hpkit.jobs.files import ArrayTask
from hpkit.jobs.sweep import describe
from hpkit.metrics.file import read_metrics
from hpkit.slurm import Backend, TransientSlurmError


@dataclass(frozen=True)
class TaskRow:
    task: str  # JOB_TASK
    overrides: dict[str, Any]
    state: str  # Slurm's, UNKNOWN when neither the controller nor sacct has the task
    step: int | None  # the last logged step
    total_steps: int | None
    loss: float | None  # the last logged step's loss
    why: str | None = None  # `hpkit why`'s verdict, first line

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def task_rows(
    backend: Backend, tasks: Sequence[ArrayTask], why: Callable[[str], str] | None = None
) -> list[TaskRow]:
    ids = [t.task_id for t in tasks]
    try:
        infos = backend.poll(ids)
    except TransientSlurmError:
        infos = {}
    rows = []
    for task in tasks:
        info = infos.get(task.task_id)
        step = loss = total = None
        if task.files is not None:
            total = task.files.total_steps
            if task.files.metrics_path.exists():
                last = read_metrics(task.files.metrics_path).last_step
                if last is not None:
                    step, loss = last.step, last.loss
        verdict = None
        if why is not None:
            try:
                verdict = why(task.task_id)
            except HpkitError as exc:
                verdict = str(exc)
        state = info.state.value if info is not None else "UNKNOWN"
        rows.append(TaskRow(task.task_id, task.overrides, state, step, total, loss, verdict))
    return rows


def format_rows(rows: Sequence[TaskRow]) -> str:
    """TASK, OVERRIDES, STATE, STEP, LOSS (and WHY when the rows have verdicts), aligned."""
    with_why = any(r.why is not None for r in rows)
    headers = ("TASK", "OVERRIDES", "STATE", "STEP", "LOSS", *(("WHY",) if with_why else ()))
    table = [headers]
    for r in rows:
        step = "-" if r.step is None else (f"{r.step}/{r.total_steps}" if r.total_steps else str(r.step))
        loss = "-" if r.loss is None else f"{r.loss:.4f}"
        cells = (r.task, describe(r.overrides) or "-", r.state, step, loss)
        table.append((*cells, *((r.why or "-",) if with_why else ())))
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )
