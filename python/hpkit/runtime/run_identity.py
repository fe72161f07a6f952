"""Who a training run is and where its files go: one answer for `hpkit train` inside the job and for
`hpkit status|plot|watch` outside it (hpkit.jobs.files), so the two cannot drift apart.

The job id is Slurm's (a requeued job keeps it, and so resumes its own checkpoints; JOB_TASK for a task of a
job array, hpkit.job_events.job_key), else torchrun's
rendezvous id (`--standalone` draws a fresh one per launch). Plain `torchrun` without `--rdzv-id` sets
that id to the placeholder `none`, which is no id: a `%j` there must not become a directory `none`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpkit import json_text
from hpkit.job_events import hangs_dir, job_key

if TYPE_CHECKING:
    from hpkit.runtime.config import RunConfig

JOB_ID_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
NOT_AN_ID = "none"  # TORCHELASTIC_RUN_ID of torchrun's default (static) rendezvous
# %j without a job id. Not a timestamp: every rank must name the same checkpoint directory, and a
# process that torchrun restarts must find the checkpoints of the one before it.
NO_JOB = "local"


# A task of a sweep (hpkit submit --sweep): its overrides as JSON, which its metrics' start records carry.
SWEEP_OVERRIDES_ENV = "HPKIT_SWEEP_OVERRIDES"


def sweep_overrides(env: Mapping[str, str] | None = None) -> dict | None:
    """This run's sweep overrides (dotted key -> value), or None outside a sweep."""
    text = (os.environ if env is None else env).get(SWEEP_OVERRIDES_ENV)
    if not text:
        return None
    try:
        value = json_text.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class RunIdentity:
    job_id: str | None  # Slurm's job id, else torchrun's rendezvous id; None outside both
    run_id: str  # the job id, else the start time: names the metrics file and the TensorBoard run

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, now: float | None = None) -> RunIdentity:
        env = os.environ if env is None else env
        # A task of a job array is JOB_TASK: its metrics, TensorBoard run and %j checkpoints are its own.
        job = job_key(env) or next(
            (v for v in (env.get(n) for n in JOB_ID_VARIABLES) if v and v != NOT_AN_ID), None
        )
        return cls(job, job or time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))

    @classmethod
    def of_job(cls, job_id: str) -> RunIdentity:
        """The identity a Slurm job's training had, seen from outside the job."""
        return cls(job_id, job_id)

    def expand(self, pattern: str) -> str:
        """%j -> the job id, as in sbatch's --output."""
        return pattern.replace("%j", self.job_id or NO_JOB)


@dataclass(frozen=True)
class RunPaths:
    metrics_file: Path
    tensorboard_dir: Path
    checkpoint_dir: Path | None  # None: the spec saves no checkpoints
    hangs_dir: Path | None = None  # the hang watchdog's heartbeats and stack dumps


def run_paths(cfg: RunConfig, identity: RunIdentity, workdir: Path | None = None) -> RunPaths:
    """Where `hpkit train` writes for `cfg`; relative paths from `workdir` (the job's working directory),
    as they are inside the job. An absolute output_dir or checkpoint.dir replaces workdir."""
    base = workdir if workdir is not None else Path()
    out = base / cfg.output_dir
    metrics = (
        out / cfg.train.metrics_file
        if cfg.train.metrics_file
        else out / f"{cfg.name}-{identity.run_id}.metrics.jsonl"
    )
    checkpoints = base / identity.expand(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    return RunPaths(
        metrics, out / "tensorboard" / f"{cfg.name}-{identity.run_id}", checkpoints, hangs_dir(out)
    )
