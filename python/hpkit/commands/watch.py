"""`hpkit status JOB` and `hpkit wait JOB --follow` for training jobs: Slurm's state plus the run's progress."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from hpkit.job_files import JobFiles, locate
from hpkit.metrics_file import MetricsReader
from hpkit.progress import Progress, progress
from hpkit.slurm import Backend, JobInfo


class JobWatcher:
    """One job's Slurm record and, for an hpkit training job, its progress; reads the metrics file incrementally."""

    def __init__(self, backend: Backend, job_id: str) -> None:
        self.backend = backend
        self.job_id = job_id
        self.files: JobFiles | None = None
        self._reader: MetricsReader | None = None

    def poll(self, info: JobInfo | None = None) -> tuple[JobInfo, Progress | None]:
        info = info or self.backend.info(self.job_id)
        located = locate(self.job_id)
        if located is not None:
            if self.files is None or located.metrics_path != self.files.metrics_path:
                self._reader = MetricsReader(located.metrics_path)
            self.files = located
        if self.files is None or self._reader is None:
            return info, None
        log = self._reader.update()
        return info, progress(
            log,
            self.files.metrics_path,
            total_steps=self.files.total_steps,
            checkpoint_dir=self.files.checkpoint_dir,
            slurm_restarts=located.slurm_restarts if located else 0,
        )


def line(info: JobInfo, prog: Progress | None) -> str:
    return info.summary() if prog is None else f"{info.summary()} | {prog.line()}"


def record(info: JobInfo, prog: Progress | None) -> dict[str, Any]:
    """Slurm's fields at the top (as before training progress existed), the run's under "training"."""
    out: dict[str, Any] = asdict(info)
    out["state"] = info.state.value
    out["training"] = prog.to_json() if prog is not None else None
    return out


def follow(
    backend: Backend,
    job_id: str,
    poll_s: float,
    timeout_s: float | None,
    stream: TextIO = sys.stdout,
) -> JobInfo:
    """Print the status line until the job ends: rewritten in place on a terminal, else one line per change.

    "Change" leaves out the ETA and speed, which move on every poll; a new step, state, checkpoint or
    restart prints a line.
    """
    from hpkit.errors import SlurmError

    watcher = JobWatcher(backend, job_id)
    tty = stream.isatty()
    start = time.monotonic()
    shown: tuple | None = None
    while True:
        info, prog = watcher.poll()
        key = (
            info.state,
            prog.step if prog else None,
            prog.checkpoint.step if prog and prog.checkpoint else None,
            prog.restarts if prog else None,
            prog.finished if prog else None,
        )
        text = line(info, prog)
        if tty:
            stream.write("\r\033[K" + text)
            stream.flush()
        elif key != shown:
            stream.write(text + "\n")
            stream.flush()
        shown = key
        if info.state.finished:
            if tty:
                stream.write("\n")
            return info
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            if tty:
                stream.write("\n")
            raise SlurmError(f"job {job_id} still {info.state.value} after {timeout_s:.0f} s")
        time.sleep(poll_s)
