"""A training job's progress in one line: step, loss, speed, ETA, last checkpoint, restarts.

Built from the job's metrics file (hpkit.metrics.file) and its checkpoint directory's commit records
(the last committed checkpoint is the one a restart resumes from, whatever the metrics say).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hpkit.metrics.file import MetricsLog
from hpkit.metrics.records import CheckpointEvent, EndEvent, StartEvent
from hpkit.runtime.checkpoints.checkpoint_record import RecordError, checkpoint_dirs, read_record

# Steps averaged for the speed and the ETA: recent enough to follow a change, long enough to smooth noise.
WINDOW = 20


@dataclass(frozen=True)
class Checkpoint:
    step: int
    saved: float | None  # epoch seconds
    path: str


@dataclass(frozen=True)
class Progress:
    step: int | None
    total_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    mfu: float | None
    step_time_s: float | None
    eta_s: float | None
    updated: float | None  # when the last step record was written (epoch seconds)
    checkpoint: Checkpoint | None
    restarts: int
    finished: bool  # the run wrote its end record after its last step
    metrics_path: str

    def line(self) -> str:
        if self.step is None:
            total = f" of {self.total_steps}" if self.total_steps else ""
            parts = [f"no steps yet{total} ({self.metrics_path} not written yet)"]
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            pct = f" ({100 * self.step / self.total_steps:.0f}%)" if self.total_steps else ""
            parts = [f"step {self.step}{total}{pct}"]
            if self.loss is not None:
                parts.append(f"loss {self.loss:.4f}")
            if self.tokens_per_s is not None:
                parts.append(f"{self.tokens_per_s:,.0f} tok/s")
            if self.mfu is not None:
                parts.append(f"MFU {self.mfu * 100:.1f}%")
            if self.finished:
                parts.append("done")
            elif self.eta_s is not None:
                parts.append(f"ETA {_duration(self.eta_s)}")
        if self.checkpoint is not None:
            when = (
                time.strftime("%H:%M:%S", time.localtime(self.checkpoint.saved))
                if self.checkpoint.saved
                else "?"
            )
            parts.append(f"ckpt step {self.checkpoint.step} ({when})")
        else:
            parts.append("no checkpoint yet")
        parts.append(f"restarts {self.restarts}")
        return " | ".join(parts)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "step_time_s": self.step_time_s,
            "eta_s": self.eta_s,
            "updated": self.updated,
            "checkpoint": None
            if self.checkpoint is None
            else {"step": self.checkpoint.step, "saved": self.checkpoint.saved, "path": self.checkpoint.path},
            "restarts": self.restarts,
            "finished": self.finished,
            "metrics_path": self.metrics_path,
        }


def last_checkpoint(root: Path | None) -> Checkpoint | None:
    """The newest directory with a commit record (not verified: that reads every byte, `hpkit ckpt ls` does)."""
    if root is None:
        return None
    for directory in reversed(checkpoint_dirs(root)):
        try:
            record = read_record(directory)
        except RecordError:
            continue
        return Checkpoint(record.step, record.created or None, str(directory))
    return None


def progress(
    log: MetricsLog,
    metrics_path: Path,
    total_steps: int | None = None,
    checkpoint_dir: Path | None = None,
    slurm_restarts: int = 0,
) -> Progress:
    last = log.last_step
    total = log.total_steps or total_steps
    recent = log.current_run_steps()
    # The first step of a run pays for start-up (allocation, compile, communicators): leave it out.
    timed = (recent[1:] if len(recent) > 1 else recent)[-WINDOW:]
    times = [s.step_time_s for s in timed if s.step_time_s is not None]
    step_time = sum(times) / len(times) if times else None
    speeds = [s.tokens_per_s for s in timed if s.tokens_per_s is not None]
    step = last.step if last else None
    # Done when the newest run record is an end that no signal caused (a requeue writes a start next).
    runs = [e for e in log.events if isinstance(e, (StartEvent, EndEvent))]
    finished = bool(runs) and isinstance(runs[-1], EndEvent) and runs[-1].stopped_by_signal is None
    eta = None
    if step is not None and total is not None and step_time is not None:
        eta = max(0, total - step) * step_time
    return Progress(
        step=step,
        total_steps=total,
        loss=last.loss if last else None,
        tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        mfu=last.mfu if last else None,
        step_time_s=step_time,
        eta_s=eta,
        updated=last.time if last else None,
        checkpoint=last_checkpoint(checkpoint_dir) or _checkpoint_from_events(log),
        restarts=max(slurm_restarts, log.restarts),
        finished=finished,
        metrics_path=str(metrics_path),
    )


def _checkpoint_from_events(log: MetricsLog) -> Checkpoint | None:
    """Where the checkpoint directory is not visible from here, the metrics file's last checkpoint record."""
    found = log.of_kind(CheckpointEvent)
    if not found:
        return None
    last = found[-1]
    return Checkpoint(last.step, last.time, last.path)


def _duration(seconds: float) -> str:
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {clock}" if days else clock
