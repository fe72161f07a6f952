"""Mixture of experts: a block's SwiGLU FFN becomes E routed experts (top-k of them per token) plus S shared ones.

Routing is Mixtral's: a linear gate scores the experts, a softmax over all of them gives probabilities, each
token goes to its top-k experts and their outputs are mixed with the top-k probabilities renormalised to
sum to 1. There is no capacity limit, so no token is ever dropped and the output does not depend on how the
batch is split over ranks.

Load balancing is a sequence-wise auxiliary loss (Switch's E * sum_e f_e * P_e, taken per sequence and
averaged, as DeepSeek-V3 does): f_e is the share of the sequence's routing slots that went to expert e and P_e
the sequence's mean router probability for e. Per sequence rather than per batch because then it is a mean
over sequences, like the language-model loss: data-parallel ranks and pipeline microbatches average to
exactly what one process computes on the whole batch. It enters training through its gradient only
(`AuxLossGrad`): the block's output is unchanged and the gradient of coef * aux / n_moe_layers is added
in backward, so it needs no path to the loss through pipeline stages. Its value is kept for the logs.

The experts' weights are 3-D (experts first), so expert parallel shards them along dim 0 and a checkpoint
holds one tensor per weight, whatever the layout. Under expert parallel (`hpkit.runtime.parallel.expert_parallel`)
tokens travel to the rank holding their expert and back with two all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpkit.models.llama.shape import MOE_DEFAULTS


@dataclass(frozen=True)
class MoEConfig:
    """The MoE settings of a LlamaConfig; defaults: hpkit.models.llama.shape.MOE_DEFAULTS."""

    experts: int = MOE_DEFAULTS["experts"]
    top_k: int = MOE_DEFAULTS["top_k"]
    shared_experts: int = MOE_DEFAULTS["shared_experts"]
    every: int = MOE_DEFAULTS["every"]  # every N-th block is a MoE block (blocks N-1, 2N-1, ...)
    aux_loss_coef: float = MOE_DEFAULTS["aux_loss_coef"]
    expert_ffn_dim: int | None = MOE_DEFAULTS["expert_ffn_dim"]  # None: the model's ffn_dim

    def is_moe_block(self, index: int) -> bool:
        return (index + 1) % self.every == 0

    def moe_blocks(self, n_layers: int) -> list[int]:
        return [i for i in range(n_layers) if self.is_moe_block(i)]


class AuxLossGrad(torch.autograd.Function):
    """Identity on `output` in forward; in backward also hands `aux` the gradient 1, so that the loss
    behaves as if `aux` had been added to it (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux)


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three 3-D weights. Under expert parallel each rank holds E / ep of them
    (a DTensor sharded on dim 0) and `ep_group` is set: tokens are exchanged with all-to-all."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n_experts = experts
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = 1

    def _local(self, weight: torch.Tensor) -> torch.Tensor:
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        # Each rank's expert gradient sums the contributions of every ep rank's tokens, each of which
        # is a mean over that rank's own batch: divide by ep so that it is the gradient of their mean,
        # as data parallel (which divides by its degree) does for every other weight.
        return ScaleGrad.apply(local, 1.0 / self.ep_size) if self.ep_size > 1 else local

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`tokens` sorted by expert, `counts[e]` rows for expert e (all E experts, on every rank)."""
        if self.ep_group is None:
            return self._compute(tokens, counts.tolist())
        return self._expert_parallel(tokens, counts)

    def _compute(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = self._local(self.w1), self._local(self.w2), self._local(self.w3)
        if not tokens.shape[0]:
            # No token reached this rank's experts: keep their weights in the graph anyway, so that every
            # rank's backward produces the same gradients (FSDP reduces them together), and keep the
            # (empty) received rows in it too: without them the dispatch all-to-all's backward runs at
            # another point of this rank's backward than of its peers', after the block's FSDP
            # reduce-scatter instead of before, and the two collectives deadlock across the ranks.
            zero = w1.sum() + w2.sum() + w3.sum() + tokens.sum()
            return tokens.new_zeros((0, tokens.shape[-1])) + 0 * zero
        # unbind, not w1[e]: indexing's backward writes each expert's gradient into a zeroed copy of the
        # whole [E, ...] tensor (43 % of a CPU step in a profile); unbind's stacks the E gradients once.
        w1s, w2s, w3s = w1.unbind(0), w2.unbind(0), w3.unbind(0)
        outs = [
            F.linear(F.silu(F.linear(rows, w1s[e])) * F.linear(rows, w3s[e]), w2s[e])
            for e, rows in enumerate(torch.split(tokens, counts))
            if rows.shape[0]
        ]
        return torch.cat(outs)

    def _expert_parallel(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return exchange_with_experts(tokens, counts, self.ep_size, self.ep_group, self._compute)


def exchange_with_experts(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    ep: int,
    group: dist.ProcessGroup,
    compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Expert parallel's round trip: `tokens` (sorted by global expert, `counts[e]` rows for expert e) go to
    the ranks that hold their experts, `compute(rows grouped by local expert, rows per local expert)` runs
    there, and the results come back in `tokens`' order. Autograd flows both ways (AllToAll)."""
    local_experts = counts.numel() // ep
    # How many rows each rank sends me for each of my experts.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    by_source = received.view(ep, local_experts)
    send_splits = counts.view(ep, local_experts).sum(1).tolist()
    recv_splits = by_source.sum(1).tolist()
    rows = AllToAll.apply(tokens, recv_splits, send_splits, group)
    # Rows arrive grouped by source rank, then expert: regroup them by expert to compute.
    sizes = by_source.tolist()
    starts, at = [], 0
    for row in sizes:
        starts.append([])
        for n in row:
            starts[-1].append(at)
            at += n
    order = torch.cat(
        [
            torch.arange(starts[s][e], starts[s][e] + sizes[s][e])
            for e in range(local_experts)
            for s in range(ep)
        ]
    ).to(rows.device)
    computed = compute(rows.index_select(0, order), by_source.sum(0).tolist())
    back = torch.empty_like(computed).index_copy(0, order, computed)
    return AllToAll.apply(back, send_splits, recv_splits, group)


class FeedForwardSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)


class MoE(nn.Module):
    """Routed experts plus shared ones in place of a block's FFN. After each forward `load` holds the
    tokens each expert received this step so far and `aux_sum`/`aux_calls` the auxiliary loss values
    (detached, for the logs; `take_stats` reads and clears them)."""

    def __init__(self, cfg: MoEConfig, dim: int, ffn_dim: int, n_moe_layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.expert_ffn_dim or ffn_dim
        self.router = Router(dim, cfg.experts)
        self.experts = GroupedExperts(cfg.experts, dim, hidden)
        self.shared = FeedForwardSwiGLU(dim, hidden * cfg.shared_experts) if cfg.shared_experts else None
        self.aux_weight = cfg.aux_loss_coef / max(n_moe_layers, 1)
        self.register_buffer("load", torch.zeros(cfg.experts), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(()), persistent=False)
        self.register_buffer("aux_calls", torch.zeros(()), persistent=False)
        # Forwards to leave out of the counters: a pipeline stage's first forward is torch's metadata
        # inference (hpkit.runtime.loop.trainer sets this), which the job never trains on.
        self.skip_forwards = 0
        # What the auxiliary loss's gradient is scaled by: a pipeline schedule that sums its microbatches'
        # gradients sets 1/microbatches (hpkit.runtime.loop.trainer).
        self.aux_grad_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        k, n_experts = self.cfg.top_k, self.cfg.experts
        flat = x.reshape(-1, dim)
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        top_p, top_i = probs.topk(k, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True)
        slots = F.one_hot(top_i, n_experts).sum(1).float()  # (tokens, E): 1 where a token chose e
        share = slots.view(bs, seq, n_experts).sum(1) / (seq * k)
        mean_p = probs.view(bs, seq, n_experts).mean(1)
        aux = n_experts * (share * mean_p).sum(-1).mean()

        chosen = top_i.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=n_experts)
        routed = self.experts(flat.index_select(0, order // k), counts)
        unsorted = torch.empty_like(routed).index_copy(0, order, routed)
        out = (unsorted.view(-1, k, dim) * weights.unsqueeze(-1).to(unsorted.dtype)).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        # Count training forwards once each: not the forwards of no-grad code, nor the second
        # forward that activation checkpointing runs inside backward.
        if self.skip_forwards:
            self.skip_forwards -= 1
        elif torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                self.load += counts.to(self.load.dtype)
                self.aux_sum += aux.detach()
                self.aux_calls += 1
        if self.training and torch.is_grad_enabled() and self.aux_weight:
            out = AuxLossGrad.apply(out, aux * (self.aux_weight * self.aux_grad_scale))
        return out.view(bs, seq, dim)

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stats = self.load.clone(), self.aux_sum.clone(), self.aux_calls.clone()
        self.load.zero_()
        self.aux_sum.zero_()
        self.aux_calls.zero_()
        return stats
