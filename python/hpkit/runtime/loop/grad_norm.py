"""Gradient norm and clipping that are right for any mix of meshes.

torch 2.13's clip_grad_norm_ fails when plain tensors and DTensors mix (TP on chosen modules) or when
DTensors live on different meshes (FSDP x TP), and under PP it returns only the local stage's norm,
so every stage would clip with a different factor. Here gradients are grouped by mesh and placement
kind, each group's norm is reduced over its own mesh, the groups are combined, and the stages' norms
are summed over the pp group.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def total_grad_norm(
    params: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None, norm_type: float = 2.0
) -> torch.Tensor:
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    device = None
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
        device = (g.to_local() if isinstance(g, DTensor) else g).device
    if device is None:
        device = torch.device("cpu")
    norms = []
    for key, grads in groups.items():
        # On DTensors, get_total_norm yields a DTensor whose full_tensor() reduces over its mesh.
        n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
        if key is not None and isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    inf = math.isinf(norm_type)
    if norms:
        stacked = torch.stack(norms)
        local = stacked.max() if inf else (stacked**norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pp_group)
    return local if inf else local ** (1.0 / norm_type)


@torch.no_grad()
def clip_grads_(params: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    # Scaling is elementwise: each rank scales its own shards by the same global factor, so the
    # local tensors of every mesh go into one foreach kernel per device and dtype.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        groups[(local.device, local.dtype)].append(local)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device, dtype))
