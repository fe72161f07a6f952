"""Reading a training run's metrics JSONL (written by hpkit.runtime.observe.metrics) without torch.

The file holds two kinds of records, one JSON object a line (their fields: hpkit.metrics.records): step
records and event records with an "event" key (start, checkpoint, end, ...). A requeued job appends to
the same file, so one file can hold several runs, each opened by a start record.

Training appends while we read: `MetricsReader` reads only whole lines, remembers where it stopped,
and leaves a half-written last line for the next call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hpkit import json_text
from hpkit.errors import HpkitError
from hpkit.metrics.records import Event, StartEvent, StepRecord, parse_record

E = TypeVar("E", bound=Event)


@dataclass
class MetricsLog:
    """Everything read so far, in file order."""

    steps: list[StepRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    run_starts: list[int] = field(default_factory=list)  # index into `steps` where each run began

    def of_kind(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def last_step(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None

    @property
    def total_steps(self) -> int | None:
        for event in reversed(self.events):
            total = getattr(event, "total_steps", None)
            if isinstance(total, int) and not isinstance(total, bool):
                return total
        return None

    @property
    def restarts(self) -> int:
        """Runs after the first: every start record opens a run."""
        return max(0, len(self.of_kind(StartEvent)) - 1)

    def current_run_steps(self) -> list[StepRecord]:
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
            record = json_text.loads(raw)
        except ValueError:
            raise HpkitError(
                f"{self.path}:{self._line}: not a JSON record: is this an hpkit metrics file (train.metrics_file)?"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise HpkitError(
                f"{self.path}:{self._line}: a record without an integer 'step': "
                "is this an hpkit metrics file (train.metrics_file)?"
            )
        parsed = parse_record(record)
        if isinstance(parsed, StepRecord):
            self.log.steps.append(parsed)
            return
        self.log.events.append(parsed)
        if isinstance(parsed, StartEvent):
            self.log.run_starts.append(len(self.log.steps))


def read_metrics(path: Path) -> MetricsLog:
    if not path.is_file():
        raise HpkitError(f"{path}: no such file: give a metrics JSONL (train.metrics_file) or a job id")
    return MetricsReader(path).update()
