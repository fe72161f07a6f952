"""What an @smp.step has in flight: the running step, the pipeline run whose loss the schedule asks for,
and the last stage's result sends.

Its own module, below the model (model.backward and the pipeline schedule read it), the step machinery
(which sets it) and the topology (which drains the sends at exit), so that the three import it and not
each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from hpkit.runtime.parallel.parallel_dims import MeshCoords


@dataclass
class RunningStep:
    microbatches: int
    pipeline: bool
    losses: list[torch.Tensor | None] = field(default_factory=list)


class PipelineRun(Protocol):
    def loss_fn(self, output: Any, index: torch.Tensor) -> torch.Tensor: ...


_active: RunningStep | None = None
_pipeline_run: PipelineRun | None = None
# The last stage's sends of step results, still in flight: the last stage does not wait for the other
# stages to finish their backward passes (a blocking broadcast there cost ~20 % of a step).
pending_sends: list[tuple[Any, torch.Tensor]] = []


def in_step() -> bool:
    return _active is not None


def backward_in_step(loss: torch.Tensor) -> bool:
    """model.backward inside a step; False outside one (the caller then runs loss.backward())."""
    if _active is None:
        return False
    if _active.pipeline:
        _active.losses.append(loss)  # the schedule runs backward
    else:
        (loss / _active.microbatches).backward()
    return True


@contextlib.contextmanager
def running(state: RunningStep) -> Iterator[RunningStep]:
    global _active
    _active = state
    try:
        yield state
    finally:
        _active = None


@contextlib.contextmanager
def pipeline_running(run: PipelineRun) -> Iterator[PipelineRun]:
    global _pipeline_run
    _pipeline_run = run
    try:
        yield run
    finally:
        _pipeline_run = None


def _schedule_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    assert _pipeline_run is not None
    return _pipeline_run.loss_fn(output, target)


def build_schedule(
    local: torch.nn.Module, coords: MeshCoords, device: torch.device, microbatches: int, schedule: str
) -> Any:
    """The model's pipeline schedule; its loss function is the running step's (see step.py)."""
    from hpkit.runtime.parallel.pipeline import build_schedule as hpkit_schedule

    return hpkit_schedule(local, coords.pp_mesh, device, microbatches, schedule, _schedule_loss)


def finish_sends() -> None:
    while pending_sends:
        work, _buffer = pending_sends.pop()
        work.wait()
