"""Pipeline parallel: split the decoder into one stage per pp rank and drive it with GPipe or 1F1B.

The split deletes what a stage does not own from a full (meta-device) model, keeping the owned
modules' names, so that checkpoints are keyed the same in every layout and DCP can reshard them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from hpkit.errors import SpecError

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """Blocks of one stage: contiguous and as even as possible, earlier stages taking the remainder
    (the last stage also carries the output head, the largest single matmul)."""
    if n_layers < pp:
        raise SpecError(f"parallelism.pp={pp} needs at least {pp} blocks; the model has {n_layers}")
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def split_model(model: nn.Module, pp: int, stage: int) -> nn.Module:
    part = copy.deepcopy(model) if pp > 1 else model
    keep = {str(i) for i in stage_layers(model.cfg.n_layers, pp, stage)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != pp - 1:
        part.norm = None
        part.output = None
    return part


def build_schedule(
    part: nn.Module,
    pp_mesh: DeviceMesh,
    device: torch.device,
    microbatches: int,
    schedule: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    stage_index = pp_mesh.get_local_rank()
    stage = PipelineStage(part, stage_index, pp_mesh.size(), device, group=pp_mesh.get_group())
    # scale_grads divides the summed microbatch gradients by their number: the gradient of the mean loss.
    return SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


def check_microbatches(local_batch: int, microbatches: int) -> None:
    if local_batch % microbatches:
        raise SpecError(
            f"train.local_batch_size={local_batch} is not divisible by parallelism.microbatches={microbatches}"
        )
