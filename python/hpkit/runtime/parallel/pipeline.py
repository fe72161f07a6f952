"""Pipeline parallel: split the decoder into stages and drive them with one of torch's schedules.

pp ranks hold `stages_per_rank` stages each (torchtitan's `model_parts`): one with GPipe and 1F1B,
one or more with interleaved 1F1B (stage i on rank i % pp, "loop" placement), exactly two with
zero bubble (torch's ZBVZeroBubble: rank r holds stages r and 2*pp-1-r, "V" placement).

Which stages a rank holds and which blocks a stage holds are hpkit.layout_rules.pipeline's (the planner's too).
The split deletes what a stage does not own from a full (meta-device) model, keeping the owned
modules' names, so that checkpoints are keyed the same in every layout and DCP can reshard them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpkit.errors import SpecError
from hpkit.layout_rules.pipeline import (
    MULTI_STAGE_SCHEDULES,
    TORCH_CLASSES,
    microbatch_problem,
    stage_ids,
    stage_layers,
)
from hpkit.models.adapters import ModelAdapter, adapter_of


def schedule_class(schedule: str) -> type:
    """torch's class that runs `schedule` (hpkit.layout_rules.pipeline.TORCH_CLASSES): those of MULTI_STAGE_SCHEDULES take a
    list of stages, the others one stage. Imported when a pipeline is built, not with this module:
    torch.distributed.pipelining imports torch._dynamo (0.5 CPU-s more for every rank, measured on CPU here),
    which only pipeline-parallel runs use."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, TORCH_CLASSES[schedule])


def split_model(
    model: nn.Module, n_stages: int, stage: int, adapter: ModelAdapter | None = None
) -> nn.Module:
    adapter = adapter or adapter_of(model)
    part = copy.deepcopy(model) if n_stages > 1 else model
    blocks = stage_layers(len(adapter.blocks(model)), n_stages, stage)
    return adapter.keep_stage(part, blocks, first=stage == 0, last=stage == n_stages - 1)


def build_schedule(
    parts: nn.Module | Sequence[nn.Module],
    pp_mesh: DeviceMesh,
    device: torch.device,
    microbatches: int,
    schedule: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scale_grads: bool = True,
):
    """The schedule over this rank's parts: one module, or `stages_per_rank` of them in `stage_ids` order.

    scale_grads divides the summed microbatch gradients by their number: the gradient of the mean of
    per-microbatch losses. The trainer turns it off: its loss function is already weighted by the step's
    token count (hpkit.runtime.loop.loss), so the microbatches' gradients simply add up."""
    from torch.distributed.pipelining import PipelineStage  # see schedule_class

    parts = [parts] if isinstance(parts, nn.Module) else list(parts)
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_stages = pp * len(parts)
    stages = [
        PipelineStage(part, index, n_stages, device, group=pp_mesh.get_group())
        for part, index in zip(parts, stage_ids(rank, pp, len(parts), schedule), strict=True)
    ]
    cls = schedule_class(schedule)
    if schedule not in MULTI_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def check_microbatches(local_batch: int, microbatches: int) -> None:
    if problem := microbatch_problem(local_batch, microbatches):
        raise SpecError(problem)
