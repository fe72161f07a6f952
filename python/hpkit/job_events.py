"""What a training job leaves for others to read: its files beside its log, its hang folders, its exit code
for a hang, and the status lines `hpkit why` reads in its output.

`hpkit.supervise` (the batch script's supervisor) writes the first three, `hpkit train`'s hang watchdog the
hang folders; the supervisor and `hpkit why` read them. They live in the job's output folder (where `#SBATCH
--output` puts the log), named by the job id, so that every run of a requeued job, on whichever batch host,
finds the same ones:

- `.hpkit-<job>.events.jsonl`: one JSON object a line, appended: what the supervisor saw and did. Every event
  has `type`, `time` (Unix seconds), `job`, `restart` (Slurm's restart count of the run) and `attempt` (the
  step's attempt inside the run); the other fields are the type's (see the constants below).
- `.hpkit-<job>.runs`: `nodes LIST` for the current run, `requeued-by-hpkit K` when hpkit requeued the job.
- `.hpkit-<job>.budget.json`: the one restart budget, across requeues and restarts inside the allocation.
- `<output_dir>/hangs/<job>-<restart>-<attempt>-<elastic restart>-step<N>/`: the hang watchdog's stacks of
  every rank, `culprit_nodes` (one node a line, written first) and `verdict.json` (last: its appearance is the
  signal). The watchdog writes them; the supervisor and `hpkit why` read them.

Each status line another program reads (`hpkit why`, hpkit.jobs.why_scan) has its pair here: the function the
writer formats it with and, beside it, the parser the reader calls, so that a rewording cannot pass unseen.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, TypeVar

from hpkit import json_text

# Event types.
RUN_STARTED = (
    "run_started"  # nodes, batch_host, max_restarts, budget_left, launcher, hangs_dir, logs, requeued_by
)
USR1 = "usr1"  # Slurm's warning signal reached the supervisor
STEP_STARTED = "step_started"  # nodes, spares, logs (each log file's size then)
STEP_ENDED = "step_ended"  # exit, signalled, tasks (srun's per-task errors: node, tasks, outcome, exit_code)
STEP_FAILING = "step_failing"  # tasks (srun's per-task errors so far), ranks (torchrun agents' failed ranks), stays (ranks staying in their processes), verdict: the grace before the stop begins
PROBE = "probe"  # nodes asked; unanswering (srun), down (sinfo) or all_answer (one srun over all)
SPARE_SWAP = "spare_swap"  # node, spare, spares_left
REPLACE_ASKED = (
    "replace_asked"  # node, ok (HyperPod: scontrol update node=X state=fail reason=Action:Replace)
)
RESTART = "restart"  # reason (hang | node | killed), verdict, nodes, budget_left: the step restarts in the allocation
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
            event = json_text.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("type"), str):
            yield number, line, event


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` with `data` as JSON: written to a temporary file beside it, then renamed."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# The hang watchdog's folders.
# Every rank's exit after the watchdog stopped a hung step (EX_TEMPFAIL): the supervisor restarts the step.
HANG_EXIT = 75
HANGS = "hangs"  # beside the job's log, in its output folder
VERDICT = "verdict.json"
CULPRIT_NODES = "culprit_nodes"
VERDICT_JUDGE = "judge"  # the verdict's key: the node whose watchdog judged (the supervisor weighs it)
_HANG_FOLDER = re.compile(r"^(\d+(?:_\d+)?)-(\d+)-(\d+)-[^/]*-step\d+$")  # JOB or JOB_TASK

_P = TypeVar("_P", bound=PurePath)


def hangs_dir(output_dir: _P) -> _P:
    """Where `hpkit train`'s watchdog writes under the job's output folder."""
    return output_dir / HANGS


def hang_attempt(job: str, restart: str, attempt: str, elastic_restart: str) -> str:
    """One attempt's key (the start of its hang folders' names): Slurm's job id (or torchrun's run id), its restart
    count, the supervisor's step attempt and torchrun's restart count."""
    return "-".join(p.replace("/", "_") for p in (job, restart, attempt, elastic_restart))


def hang_folder(hangs: Path, attempt: str, step: int) -> Path:
    """The folder of the hang of `step` (the step that did not finish) in the attempt `hang_attempt` names."""
    return hangs / f"{attempt}-step{step}"


def verdict_paths(
    hangs: Path, job_id: str, restart: int | None = None, attempt: int | None = None
) -> list[Path]:
    """The job's verdicts, sorted; only those of one run (`restart`) and step attempt when given."""
    run = "" if restart is None and attempt is None else f"-{_or_any(restart)}-{_or_any(attempt)}"
    return sorted(hangs.glob(f"{job_id}{run}-*-step*/{VERDICT}"))


def _or_any(number: int | None) -> str:
    return "*" if number is None else str(number)


def verdict_restart(verdict: Path) -> int | None:
    """The Slurm restart count of the run a verdict is from (its folder's name says it)."""
    match = _HANG_FOLDER.match(verdict.parent.name)
    return int(match.group(2)) if match else None


def verdict_folder(verdict: str) -> str:
    """The hang folder of a verdict's path as the events file holds it."""
    return verdict.removesuffix(f"/{VERDICT}")


# Status lines. The writer formats with the first function of each pair; `hpkit why` parses with the second.
HANG_PREFIX = "hpkit: hang: "
_STACKS_IN = "; stacks of every rank in "
CULPRIT_UNKNOWN = "the culprit cannot be told"
_HANG = re.compile(rf"^{re.escape(HANG_PREFIX)}.*?{re.escape(_STACKS_IN)}(\S+)$")
_HANG_WHO = re.compile(r"rank (\d+) on (\S+?)[ ,]")


def hang_culprits(culprits: Iterable[tuple[int, str]]) -> str:
    """`rank R on NODE, ...`: the ranks a hang line names, with their nodes."""
    return ", ".join(f"rank {rank} on {node}" for rank, node in culprits)


def hang_text(text: str) -> str:
    """A hang verdict's line (verdict.json's `line`): `hpkit: hang: ` and what the watchdog saw."""
    return HANG_PREFIX + text


def hang_line(text: str, stacks: str | PurePath) -> str:
    """The line the verdict's writer prints: the verdict's line and where the stacks are."""
    return f"{text}{_STACKS_IN}{stacks}"


@dataclass(frozen=True)
class HangLine:
    text: str  # the verdict's line
    stacks: str  # the hang folder
    rank: int | None  # the first culprit, where the line names one
    node: str | None


def parse_hang_line(line: str) -> HangLine | None:
    match = _HANG.match(line)
    if match is None:
        return None
    who = _HANG_WHO.search(line) if CULPRIT_UNKNOWN not in line else None
    rank, node = (int(who.group(1)), who.group(2)) if who else (None, None)
    return HangLine(line.split(_STACKS_IN)[0], match.group(1), rank, node)


FAULT_ENV = "HPKIT_FAULT"
_BEFORE_STEP = "before step"
_IN_EVAL = "in the validation after step"
_FAULT = re.compile(
    rf"^hpkit: fault injected \({FAULT_ENV}\): (\w+) on rank (\d+) (?:{_BEFORE_STEP}|{_IN_EVAL}) (\d+)"
)


def fault_line(kind: str, rank: int, step: int, in_eval: bool = False) -> str:
    """The fault injector's line, printed by the rank it acts on just before it does: before `step`, or in the
    validation after it."""
    return f"hpkit: fault injected ({FAULT_ENV}): {kind} on rank {rank} {_IN_EVAL if in_eval else _BEFORE_STEP} {step}"


def parse_fault_line(line: str) -> tuple[str, int, int] | None:
    """(kind, rank, step) of a fault injector's line."""
    match = _FAULT.match(line)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else None


AGENT_PREFIX = "hpkit-torchrun: "
# srun's `R: ` label allowed in front: the supervisor reads srun's lines as they come.
_RANK_FAILED = re.compile(
    rf"^(?:\s*\d+: )?{re.escape(AGENT_PREFIX)}rank (\d+) failed on (\S+) \(exit code (-?\d+)\)"
)


@dataclass(frozen=True)
class RankFailed:
    rank: int
    node: str
    exit_code: int  # torchrun's: -N where signal N killed the rank


def rank_failed_line(rank: int, node: str, exitcode: int) -> str:
    """hpkit-torchrun's line for each of its node's ranks that failed: the node a rank ran on. Under torchrun srun's
    task lines cannot say it: their task ids count nodes, the ranks' order is the rendezvous's, and srun may report
    a peer's agent (exit 1) and kill this one (--kill-on-bad-exit) before it reports its own exit."""
    return f"{AGENT_PREFIX}rank {rank} failed on {node} (exit code {exitcode})"


def parse_rank_failed_line(line: str) -> RankFailed | None:
    match = _RANK_FAILED.match(line)
    return RankFailed(int(match.group(1)), match.group(2), int(match.group(3))) if match else None


TRAIN_PREFIX = "hpkit train: "
_STAYS = re.compile(rf"{re.escape(TRAIN_PREFIX)}rank (\d+) on (\S+) stays in process (\d+) for the next step")


@dataclass(frozen=True)
class RankStays:
    rank: int
    node: str
    pid: int


def stays_line(rank: int, node: str, pid: int, why: str) -> str:
    """hpkit train's line for a rank whose process group broke and that stays in its process, parked, for the next
    step (resilience.keep_survivors). Its task does not end, so the supervisor reads the line as a failing step."""
    return f"{TRAIN_PREFIX}rank {rank} on {node} stays in process {pid} for the next step: {why}"


def parse_stays_line(line: str) -> RankStays | None:
    """A stays line, anywhere in the line (srun's --label puts the rank before it)."""
    match = _STAYS.search(line)
    return RankStays(int(match.group(1)), match.group(2), int(match.group(3))) if match else None


_STOPPED = re.compile(rf"^{re.escape(TRAIN_PREFIX)}(stopping at step (\d+) on signal (\d+))")


def stopping_text(step: int, signal: int) -> str:
    """A run stopped by a signal, after a checkpoint at `step`: the line's words, which `why` also shows for
    the metrics file's end record."""
    return f"stopping at step {step} on signal {signal}"


def stopping_line(step: int, signal: int) -> str:
    return TRAIN_PREFIX + stopping_text(step, signal)


def parse_stopping_line(line: str) -> tuple[str, int, int] | None:
    """(the words, step, signal) of a stopping line."""
    match = _STOPPED.match(line)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else None


_DONE = TRAIN_PREFIX + "done "


def done_line(fields: dict[str, str]) -> str:
    """The run's summary when it finished its steps: `hpkit train: done steps=N final_loss=X ...` (values have no
    spaces)."""
    return _DONE + " ".join(f"{key}={value}" for key, value in fields.items())


def parse_done_line(line: str) -> dict[str, str] | None:
    """The fields of a done line."""
    if not line.startswith(_DONE):
        return None
    fields = {}
    for part in line[len(_DONE) :].split():
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value
    return fields
