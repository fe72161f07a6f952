"""`hpkit plan --trial K`: the search's top K layouts run as short jobs, and what they measured beside what was
predicted, re-ranked by the measurement.

Each trial is the spec `--write` would write for its layout (hpkit.plan.recipe.layout_spec) under a base spec's
job fields (partition, time limit, output dir, container, launcher, ...), submitted through the normal path
(hpkit.jobs.submission: prepare, submit) and waited for (hpkit.jobs.watch.wait_for). Its measured tokens/s
and peak memory come from its metrics file (hpkit.metrics.file): the median over the steps after the warm-up.
A trial that cannot be submitted, runs out of memory or fails is a row saying so.

The pure parts (`choose`, `trial_spec`, `measure`, `failure`, `rerank`, `table`) are apart from the one that
talks to Slurm (`run_trials`). Torch-free: it runs on a login node.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from hpkit.errors import HpkitError, SlurmError
from hpkit.metrics.file import MetricsLog
from hpkit.plan.recipe import layout_spec
from hpkit.plan.search import Candidate, SearchResult
from hpkit.plan.speed import Hardware
from hpkit.slurm import Backend, JobInfo, JobState

TRIAL_STEPS = 8
WARMUP_STEPS = 2  # the first steps build caches, allocate and connect: not the layout's speed
DEFAULT_TIME_LIMIT = "00:20:00"
DEFAULT_OUTPUT_DIR = "plan-trials"
# Job fields a trial takes from no base spec, and what it uses instead (named in one line to the user).
DEFAULTED = (
    "partition (the cluster's default)",
    f"time_limit ({DEFAULT_TIME_LIMIT})",
    f"output_dir ({DEFAULT_OUTPUT_DIR})",
    "container (none: the hpkit on this PATH)",
)
# A base spec's blocks a trial leaves out: a few steps must not resume from, write over or validate against the
# real run's checkpoints and held-out set.
_RUN_ONLY = ("checkpoint", "eval")
# Train fields a trial sets whatever the base says: it logs every step to its own metrics file, and starts no
# exporter that would listen on the base's port.
_TRIAL_TRAIN = {"log_every": 1, "metrics_file": None, "tensorboard": False, "prometheus": None}
# The words a job log holds when a rank ran out of GPU (or host) memory.
_OOM_WORDS = ("out of memory", "outofmemoryerror", "oom-kill", "oom_kill")


@dataclass(frozen=True)
class Measured:
    tokens_per_s: float  # the whole job's, median over the measured steps
    tokens_per_s_per_gpu: float
    peak_memory_gib: float | None  # rank 0's peak over the run
    memory_kind: str | None  # max_allocated (CUDA) or max_rss (CPU)
    steps: int  # steps the median is over


@dataclass
class Trial:
    predicted_rank: int  # 1-based, in the search's order
    candidate: Candidate
    name: str
    job_id: str | None = None
    state: str | None = None
    measured: Measured | None = None
    problem: str | None = None  # why it has no measurement (None: it has one)

    def to_json(self) -> dict[str, Any]:
        c = self.candidate
        out: dict[str, Any] = {
            "predicted_rank": self.predicted_rank,
            "layout": c.layout.describe(),
            "name": self.name,
            "job_id": self.job_id,
            "state": self.state,
            "predicted_tokens_per_s_per_gpu": round(c.speed.tokens_per_s_per_gpu, 1) if c.speed else None,
            "predicted_peak_gib": round(c.peak_gib, 3) if c.peak_gib is not None else None,
            "measured_tokens_per_s_per_gpu": None,
            "measured_peak_gib": None,
            "problem": self.problem,
        }
        if self.measured is not None:
            m = self.measured
            out |= {
                "measured_tokens_per_s_per_gpu": round(m.tokens_per_s_per_gpu, 1),
                "measured_tokens_per_s": round(m.tokens_per_s, 1),
                "measured_peak_gib": round(m.peak_memory_gib, 3) if m.peak_memory_gib is not None else None,
                "memory_kind": m.memory_kind,
                "measured_steps": m.steps,
            }
        return out


def choose(result: SearchResult, k: int, prefix: str) -> list[Trial]:
    """The search's top `k` layouts that fit, as trials named `prefix`-trial<predicted rank>."""
    return [Trial(i + 1, c, f"{prefix}-trial{i + 1}") for i, c in enumerate(result.ranked[:k])]


def job_fields(base: dict[str, Any] | None, hw: Hardware) -> dict[str, Any]:
    """A trial's job-level fields: the base spec's (validated: its defaults spelled out) where there is one,
    else the defaults DEFAULTED names. Never the base's name or node count: the search's."""
    if base is None:
        return {
            "gpus_per_node": hw.gpus_per_node,
            "instance_type": hw.name,
            "time_limit": DEFAULT_TIME_LIMIT,
            "output_dir": DEFAULT_OUTPUT_DIR,
            "launcher": "torchrun",
            "command": ["hpkit", "train"],
        }
    job = {
        k: v
        for k, v in base.items()
        if k not in ("name", "nodes", "parallelism", "model", "train", *_RUN_ONLY)
    }
    if not job.get("time_limit"):
        job["time_limit"] = DEFAULT_TIME_LIMIT
    resilience = dict(job.get("resilience") or {})
    # A trial that fails is a row in the table, not a job to requeue onto other nodes.
    resilience |= {"max_restarts": 0, "spare_nodes": 0}
    job["resilience"] = resilience
    return job


def trial_spec(
    trial: Trial,
    model: dict[str, Any],
    hw: Hardware,
    nodes: int,
    job: dict[str, Any],
    base_train: dict[str, Any] | None = None,
    steps: int = TRIAL_STEPS,
) -> dict[str, Any]:
    """The spec `--write` writes for the trial's layout (recipe.layout_spec), with the base's job fields over
    it and the base's train fields under the layout's, for `steps` steps logged one by one."""
    spec = layout_spec(trial.name, model, hw, nodes, trial.candidate.layout, steps)
    spec |= job
    spec["name"], spec["nodes"] = trial.name, nodes
    train = {k: v for k, v in (base_train or {}).items() if k not in ("steps", "warmup_steps")}
    spec["train"] = {**train, **spec["train"], **_TRIAL_TRAIN}
    # A base that names no instance_type (or partition, ...) leaves it out, as its own job does.
    return {k: v for k, v in spec.items() if v is not None}


def measure(log: MetricsLog, world: int, warmup: int = WARMUP_STEPS) -> Measured | None:
    """The median tokens/s over the run's steps after the first `warmup`, and rank 0's peak memory over all
    of them; None when no step came after the warm-up."""
    steps = log.current_run_steps()
    timed = [s for s in steps if s.tokens_per_s is not None]
    kept = timed[warmup:]
    if not kept:
        return None
    tps = float(statistics.median(s.tokens_per_s or 0.0 for s in kept))
    memory = [s for s in steps if s.memory_gib is not None]
    peak = max(memory, key=lambda s: s.memory_gib or 0.0) if memory else None
    return Measured(
        tokens_per_s=tps,
        tokens_per_s_per_gpu=tps / max(1, world),
        peak_memory_gib=peak.memory_gib if peak else None,
        memory_kind=peak.memory_kind if peak else None,
        steps=len(kept),
    )


def failure(info: JobInfo, log_tail: str = "", logged_steps: int = 0, warmup: int = WARMUP_STEPS) -> str:
    """Why a trial has no measurement, in one phrase."""
    state = info.state
    job = f"job {info.job_id}"
    if state == JobState.OUT_OF_MEMORY or any(w in log_tail.lower() for w in _OOM_WORDS):
        return f"out of memory ({job} {state.value}): the planner's estimate is short for this layout"
    if state == JobState.TIMEOUT:
        return f"reached its time limit ({job}): give the base spec a longer time_limit"
    if state == JobState.COMPLETED:
        return (
            f"{job} completed with {logged_steps} step record(s), none after the {warmup} warm-up steps: "
            "is train.metrics_file written (hpkit train)?"
        )
    code = f", exit code {info.exit_code}" if info.exit_code is not None else ""
    return f"{state.value.lower()}{code}: `hpkit why {info.job_id}` says why"


def rerank(trials: list[Trial]) -> list[Trial]:
    """Measured trials first, fastest first; then the others in their predicted order."""
    measured = [t for t in trials if t.measured is not None]
    measured.sort(key=lambda t: -(t.measured.tokens_per_s_per_gpu if t.measured else 0.0))
    rest = sorted((t for t in trials if t.measured is None), key=lambda t: t.predicted_rank)
    return measured + rest


HEADER = (
    "#",
    "pred #",
    "layout",
    "pred tok/s/GPU",
    "meas tok/s/GPU",
    "pred GiB",
    "meas GiB",
    "job",
    "result",
)


def _row(i: int, t: Trial) -> tuple[str, ...]:
    c, m = t.candidate, t.measured
    mem = "-"
    if m is not None and m.peak_memory_gib is not None:
        mem = f"{m.peak_memory_gib:.2f}" + (f" ({m.memory_kind})" if m.memory_kind else "")
    return (
        str(i) if m is not None else "-",
        str(t.predicted_rank),
        c.layout.describe(),
        f"{c.speed.tokens_per_s_per_gpu:,.0f}" if c.speed else "-",
        f"{m.tokens_per_s_per_gpu:,.0f}" if m else "-",
        f"{c.peak_gib:.2f}" if c.peak_gib is not None else "-",
        mem,
        t.job_id or "-",
        f"ok, median of {m.steps} steps" if m and not t.problem else (t.problem or ""),
    )


def table(trials: list[Trial]) -> str:
    """The re-ranked trials, predicted and measured side by side."""
    rows = [_row(i + 1, t) for i, t in enumerate(trials)]
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [HEADER, *rows]
    )


def _log_tail(path: str | None, limit: int = 65536) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_trials(
    trials: list[Trial],
    specs: list[dict[str, Any]],
    folder: Path,
    backend: Backend,
    world: int,
    *,
    poll_s: float = 2.0,
    warmup: int = WARMUP_STEPS,
    stream: TextIO = sys.stderr,
) -> list[Trial]:
    """Write, submit and wait for each trial's spec; fill in each trial's job, state and measurement (or
    problem). Ctrl-C (or an error while waiting) cancels the trials already submitted, then goes on up."""
    from hpkit.jobs.files import files_for
    from hpkit.jobs.submission import job_workdir, prepare, submit, write_new
    from hpkit.jobs.watch import wait_for
    from hpkit.metrics.file import read_metrics

    submitted: dict[str, Trial] = {}
    workdirs: dict[str, tuple[Path, Path]] = {}
    try:
        for trial, spec in zip(trials, specs, strict=True):
            path = folder / f"{trial.name}.yaml"
            try:
                write_new(path, yaml.safe_dump(spec, sort_keys=False))
                submission = prepare(path)
                job = submit(submission, backend)
            except HpkitError as exc:
                trial.problem = f"not submitted: {exc}"
                print(f"hpkit plan: trial #{trial.predicted_rank}: {trial.problem}", file=stream, flush=True)
                continue
            trial.job_id = job.job_id
            submitted[job.job_id] = trial
            workdirs[job.job_id] = (submission.spec_copy, job_workdir(submission.spec.job))
            print(
                f"hpkit plan: trial #{trial.predicted_rank} ({trial.candidate.layout.describe()}): job "
                f"{job.job_id}, output {submission.log_file(job.job_id)}",
                file=stream,
                flush=True,
            )
        infos = wait_for(backend, list(submitted), poll_s=poll_s) if submitted else {}
    except BaseException:
        _cancel(backend, submitted, stream)
        raise
    for job_id, trial in submitted.items():
        info = infos[job_id]
        trial.state = info.state.value
        spec_copy, workdir = workdirs[job_id]
        files = files_for(job_id, spec_copy, workdir)
        log = MetricsLog()
        if files is not None and files.metrics_path.is_file():
            try:
                log = read_metrics(files.metrics_path)
            except HpkitError as exc:
                trial.problem = str(exc)
                continue
        trial.measured = measure(log, world, warmup)
        if info.state != JobState.COMPLETED or trial.measured is None:
            trial.problem = failure(info, _log_tail(info.stdout), len(log.steps), warmup)
    return trials


def _cancel(backend: Backend, submitted: dict[str, Trial], stream: TextIO) -> None:
    if not submitted:
        return
    for job_id in submitted:
        with contextlib.suppress(SlurmError, OSError):
            backend.cancel(job_id)
    print(f"hpkit plan: cancelled the trial jobs {', '.join(submitted)}", file=stream, flush=True)
