"""`hpkit status JOB` and `hpkit wait JOB --follow` for training jobs: Slurm's state plus the run's progress."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any, TextIO

from hpkit.errors import SlurmError
from hpkit.job_files import JobFiles, locate
from hpkit.metrics_file import MetricsReader
from hpkit.progress import Progress, progress
from hpkit.slurm import OUTAGE_LIMIT_S, Backend, JobInfo, wait


class JobWatcher:
    """One job's Slurm record and, for an hpkit training job, its progress; reads the metrics file incrementally."""

    def __init__(self, backend: Backend, job_id: str) -> None:
        self.backend = backend
        self.job_id = job_id
        self.files: JobFiles | None = None
        self._reader: MetricsReader | None = None

    def poll(
        self, info: JobInfo | None = None, *, locate_files: bool = True
    ) -> tuple[JobInfo, Progress | None]:
        """Slurm's record (or `info`, already polled) and the progress; `locate_files=False` only re-reads the
        metrics file, asking the controller nothing."""
        info = info or self.backend.info(self.job_id)
        if locate_files:
            try:
                located = locate(self.job_id, name=info.name)
            except SlurmError:  # the controller did not answer: keep what it said last
                located = None
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
            slurm_restarts=self.files.slurm_restarts,
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
    outage_limit_s: float = OUTAGE_LIMIT_S,
) -> JobInfo:
    """Print the status line until the job ends: rewritten in place on a terminal, else one line per change.

    Slurm is asked as `wait` asks it (rarer as the job ages; a controller restart is ridden out), while
    the progress comes from the metrics file between those polls. "Change" leaves out the ETA and speed,
    which move on every read; a new step, state, checkpoint or restart prints a line.
    """
    status = _StatusLine(JobWatcher(backend, job_id), stream)
    try:
        info = wait(
            backend,
            job_id,
            poll_s=poll_s,
            timeout_s=timeout_s,
            on_poll=status.show,
            on_tick=status.refresh,
            outage_limit_s=outage_limit_s,
        )
    finally:
        status.close()
    return info


class _StatusLine:
    def __init__(self, watcher: JobWatcher, stream: TextIO) -> None:
        self.watcher = watcher
        self.stream = stream
        self.tty = stream.isatty()
        self.last: JobInfo | None = None
        self.shown: tuple | None = None

    def show(self, info: JobInfo, *, polled: bool = True) -> None:
        self.last = info
        info, prog = self.watcher.poll(info, locate_files=polled)
        key = (
            info.state,
            prog.step if prog else None,
            prog.checkpoint.step if prog and prog.checkpoint else None,
            prog.restarts if prog else None,
            prog.finished if prog else None,
        )
        text = line(info, prog)
        if self.tty:
            self.stream.write("\r\033[K" + text)
        elif key != self.shown:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = key

    def refresh(self) -> None:
        """Between Slurm polls: the run's progress with the last known state."""
        if self.last is not None:
            self.show(self.last, polled=False)

    def close(self) -> None:
        if self.tty and self.shown is not None:
            self.stream.write("\n")
            self.stream.flush()
