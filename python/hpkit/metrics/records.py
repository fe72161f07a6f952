"""The records of a training run's metrics JSONL, field names in one place for the writer
(hpkit.runtime.observe.metrics, run, report) and the readers (hpkit.metrics.file, progress, plot, status).

One JSON object a line. Step records have no "event" key; event records name their kind in it. The
field names of these dataclasses are the file format: renaming one breaks every file already written
and every reader of it (tests/unit/test_metrics_records.py pins them). Torch-free: read on login nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

EVENT_KEY = "event"
TIME_KEY = "time"  # wall-clock seconds: `hpkit status --json` shows how fresh the numbers are
_MEMORY_PREFIX, _MEMORY_SUFFIX = "memory_", "_gib"
_SCALARS = ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu")
_MOE_FIELDS = ("aux_loss", "expert_load")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class StepRecord:
    """One logged training step (rank 0's view: loss and norm are already reduced)."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    memory_gib: float | None = None
    memory_kind: str | None = None  # max_allocated (CUDA) or max_rss: written as memory_<kind>_gib
    time: float | None = None
    # Mixture-of-experts runs only (absent from dense runs' records): the load-balancing loss (mean over
    # MoE blocks, before its coefficient) and the expert load (tokens of the busiest expert over the mean,
    # in the worst block; 1.0 is perfectly even).
    aux_loss: float | None = None
    expert_load: float | None = None

    def scalars(self) -> dict[str, float | None]:
        """The step's numbers under their file names (TensorBoard tags, Prometheus)."""
        out: dict[str, float | None] = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
        }
        if self.memory_kind is not None:
            out[f"{_MEMORY_PREFIX}{self.memory_kind}{_MEMORY_SUFFIX}"] = self.memory_gib
        for name in _MOE_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, **self.scalars()}
        if self.time is not None:
            out[TIME_KEY] = self.time
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        memory = next((k for k in data if k.startswith(_MEMORY_PREFIX) and k.endswith(_MEMORY_SUFFIX)), None)
        numbers = {name: _number(data.get(name)) for name in (*_SCALARS, *_MOE_FIELDS)}
        return cls(
            step=int(data["step"]),
            **numbers,
            memory_gib=_number(data.get(memory)) if memory else None,
            memory_kind=memory[len(_MEMORY_PREFIX) : -len(_MEMORY_SUFFIX)] if memory else None,
            time=_number(data.get(TIME_KEY)),
        )


@dataclass(frozen=True)
class Event:
    """Something that happened at a step. Subclasses name their `kind` and add fields."""

    kind: ClassVar[str] = ""
    step: int

    def to_json(self, time: float) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != TIME_KEY}
        return {TIME_KEY: time, EVENT_KEY: self.kind, **fields}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        kind = data.get(EVENT_KEY)
        known = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
        if known is None:  # written by a newer hpkit: kept, and passed over by the readers
            return OtherEvent(int(data["step"]), str(kind), _number(data.get(TIME_KEY)))
        values = {f.name: data[f.name] for f in dataclasses.fields(known) if f.name in data}
        values["step"] = int(data["step"])
        return known(**values)


@dataclass(frozen=True)
class StartEvent(Event):
    """A run began (a requeued job appends another to the same file)."""

    kind: ClassVar[str] = "start"
    total_steps: int | None = None
    restart: int = 0  # SLURM_RESTART_COUNT
    resumed_from: str | None = None
    world_size: int | None = None
    time: float | None = None
    # A task of a sweep (hpkit submit --sweep): its overrides, dotted key -> value; absent otherwise.
    overrides: dict[str, Any] | None = None
    # When rank 0's start-up reached each part (Unix seconds; hpkit.runtime.run.START_PHASES): where a
    # restart's seconds go (bench/bench_recovery.py). Absent where not measured.
    phases: dict[str, float] | None = None
    # resilience.keep_survivors: how many of the run's ranks stayed in their processes from an earlier step
    # (hpkit.warm.park), the others having started anew. Absent without keep_survivors.
    stayed: int | None = None

    def to_json(self, time: float) -> dict[str, Any]:
        out = super().to_json(time)
        for optional in ("overrides", "phases", "stayed"):
            if out[optional] is None:
                del out[optional]  # a run outside a sweep writes the fields it always wrote
        return out


@dataclass(frozen=True)
class EndEvent(Event):
    kind: ClassVar[str] = "end"
    total_steps: int | None = None
    stopped_by_signal: int | None = None  # None: the run reached its last step
    time: float | None = None


@dataclass(frozen=True)
class CheckpointEvent(Event):
    kind: ClassVar[str] = "checkpoint"
    path: str = ""
    time: float | None = None


@dataclass(frozen=True)
class StepTimesEvent(Event):
    """One straggler window: every rank's local work and step time, one value per rank."""

    kind: ClassVar[str] = "step_times"
    steps: int = 0
    local_work_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    time: float | None = None


@dataclass(frozen=True)
class StragglerEvent(Event):
    kind: ClassVar[str] = "straggler"
    rank: int = 0
    node: str = ""
    factor: float = 0.0
    local_work_s: float = 0.0
    median_local_work_s: float = 0.0
    windows: int = 0
    time: float | None = None


@dataclass(frozen=True)
class EvalEvent(Event):
    """A validation on the held-out set (`eval:`): the mean loss over all its counted tokens, after `step`
    steps (`only`: a validation without training, of a checkpoint or of init_from's weights)."""

    kind: ClassVar[str] = "eval"
    loss: float = 0.0
    perplexity: float = 0.0
    tokens: int = 0  # counted tokens over every data-parallel rank
    batches: int = 0
    seconds: float = 0.0
    only: bool = False
    time: float | None = None


@dataclass(frozen=True)
class OtherEvent(Event):
    """An event of a kind this hpkit does not know."""

    name: str = ""
    time: float | None = None


EVENT_KINDS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (StartEvent, EndEvent, CheckpointEvent, StepTimesEvent, StragglerEvent, EvalEvent)
}


def parse_record(data: dict[str, Any]) -> StepRecord | Event:
    """A record read from the file; `data` must hold an integer "step" (hpkit.metrics.file checks)."""
    return Event.from_json(data) if EVENT_KEY in data else StepRecord.from_json(data)
