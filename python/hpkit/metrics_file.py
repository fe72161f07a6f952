"""Reading a training run's metrics JSONL (written by hpkit.runtime.metrics) without torch.

The file holds two kinds of records, one JSON object a line: step records (step, loss, tokens_per_s,
step_time_s, mfu, time, ...) and event records with an "event" key (start, checkpoint, end). A requeued
job appends to the same file, so one file can hold several runs, each opened by a start record.

Training appends while we read: `MetricsReader` reads only whole lines, remembers where it stopped,
and leaves a half-written last line for the next call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpkit.errors import HpkitError


@dataclass
class MetricsLog:
    """Everything read so far, in file order."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    run_starts: list[int] = field(default_factory=list)  # index into `steps` where each run began

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def last_step(self) -> dict[str, Any] | None:
        return self.steps[-1] if self.steps else None

    @property
    def total_steps(self) -> int | None:
        for event in reversed(self.events):
            if isinstance(event.get("total_steps"), int):
                return event["total_steps"]
        return None

    @property
    def restarts(self) -> int:
        """Runs after the first: every start record opens a run."""
        return max(0, len(self.of_kind("start")) - 1)

    def current_run_steps(self) -> list[dict[str, Any]]:
        """The step records written since the last start record (all of them in a file without one)."""
        return self.steps[self.run_starts[-1] :] if self.run_starts else self.steps


class MetricsReader:
    """Reads a metrics file incrementally: each `update()` adds the whole lines written since the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.log = MetricsLog()
        self._offset = 0
        self._line = 0

    def update(self) -> MetricsLog:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return self.log
        except OSError as exc:
            raise HpkitError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        end = chunk.rfind(b"\n")
        if end < 0:
            return self.log  # nothing whole yet
        self._offset += end + 1
        for raw in chunk[: end + 1].splitlines():
            self._line += 1
            if raw.strip():
                self._add(raw)
        return self.log

    def _add(self, raw: bytes) -> None:
        try:
            record = json.loads(raw)
        except ValueError:
            raise HpkitError(
                f"{self.path}:{self._line}: not a JSON record: is this an hpkit metrics file (train.metrics_file)?"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise HpkitError(
                f"{self.path}:{self._line}: a record without an integer 'step': "
                "is this an hpkit metrics file (train.metrics_file)?"
            )
        if "event" not in record:
            self.log.steps.append(record)
            return
        self.log.events.append(record)
        if record["event"] == "start":
            self.log.run_starts.append(len(self.log.steps))


def read_metrics(path: Path) -> MetricsLog:
    if not path.is_file():
        raise HpkitError(f"{path}: no such file: give a metrics JSONL (train.metrics_file) or a job id")
    return MetricsReader(path).update()
