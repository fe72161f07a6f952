"""Watch jobs from Python: Slurm's state plus, for a training job, the run's progress; a job's log as it grows.

`hpkit status`, `hpkit wait [--follow]` and `hpkit logs -f` are these plus argument parsing.
"""

from __future__ import annotations

import codecs
import os
import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from hpkit.errors import SlurmError
from hpkit.jobs.files import JobFiles, locate
from hpkit.jobs.progress import Progress, progress
from hpkit.metrics.file import MetricsReader
from hpkit.slurm import (
    OUTAGE_LIMIT_S,
    Backend,
    JobInfo,
    JobState,
    polled_fields,
    print_progress,
    wait,
    wait_all,
)


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
        metrics file, asking the controller nothing. The files are found from the same poll's record: one
        Slurm call in all (the CLI backend)."""
        info = info or self.backend.info(self.job_id)
        if locate_files:
            try:
                located = locate(self.job_id, name=info.name, polled=polled_fields(self.backend, self.job_id))
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


# What one read of a job's log takes: a log of many GB (a job attached late, `hpkit logs` of a long run) is copied a
# chunk at a time, never held whole in memory.
CHUNK_BYTES = 1 << 20


class LogFollower:
    """Prints what a job's output file gained since the last call, a chunk at a time."""

    def __init__(self, stream: TextIO | None = None) -> None:
        # sys.stdout as it is when the follower is made, not when this module was imported (a caller that
        # redirected stdout since, such as a test's capture, gets the copy).
        self.stream = stream if stream is not None else sys.stdout
        self.offset = 0
        self.last: JobInfo | None = None
        # UTF-8 decoded across chunks: a character cut by a chunk's end is completed by the next read.
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def remember(self, info: JobInfo) -> None:
        self.last = info
        self.pump(info)

    def pump_last(self) -> None:
        """Between polls: the file grows without asking Slurm anything."""
        if self.last is not None:
            self.pump(self.last)

    def pump(self, info: JobInfo) -> None:
        """Copy what the file holds past the last offset, up to its size now (a fast writer cannot keep this
        call going). A file shorter than what was read (a requeued job that truncated its output) is read from
        its start."""
        if not info.stdout:
            return
        try:
            handle = open(info.stdout, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            return
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size < self.offset:
                self.offset = 0
                self.decoder.reset()
            handle.seek(self.offset)
            while self.offset < size and (chunk := handle.read(min(CHUNK_BYTES, size - self.offset))):
                self.offset += len(chunk)
                self.stream.write(self.decoder.decode(chunk))
        self.stream.flush()


def wait_for(
    backend: Backend,
    job_ids: list[str],
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    outage_limit_s: float = OUTAGE_LIMIT_S,
    show_log: bool = False,
) -> dict[str, JobInfo]:
    """Wait for every job to end, printing state changes; `show_log` streams a single job's output too."""
    # Output of one job at a time: following several would interleave their logs.
    follower = LogFollower() if show_log and len(job_ids) == 1 else None
    infos = wait_all(
        backend,
        job_ids,
        poll_s=poll_s,
        timeout_s=timeout_s,
        on_change=print_progress,
        on_poll=follower.remember if follower else None,
        on_tick=follower.pump_last if follower else None,
        outage_limit_s=outage_limit_s,
    )
    if follower:
        # The last lines can land just after the state flips.
        time.sleep(0.3)
        follower.pump(infos[job_ids[0]])
    return infos


def exit_status(infos: dict[str, JobInfo]) -> int:
    """0 when every job completed, else the exit code of the first that did not (1 when it has none): failed,
    cancelled, or preempted without a requeue. A requeued preemption is never here: wait_all waits on."""
    failed = [i for i in infos.values() if i.state != JobState.COMPLETED]
    return failed[0].exit_code or 1 if failed else 0
