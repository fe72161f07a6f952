"""Expert parallel for Hugging Face Mixtral's experts (`MixtralExperts`: gate_up_proj [E, 2I, H], down_proj
[E, H, I]): each ep rank holds E / ep experts and tokens travel to them and back by all-to-all.

The weights become DTensors sharded on dim 0 over the ep mesh, so checkpoints keep whole [E, ...] tensors.
The exchange is hpkit's own (hpkit.models.llama.moe: AllToAll with autograd, and the 1/ep gradient scale that
makes an expert's gradient the mean over the ep ranks' batches, as data parallel does for dense weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hpkit.compat.smp_v2.state import bad_config
from hpkit.models.llama.moe import ScaleGrad, exchange_with_experts


def _local(weight: torch.Tensor, ep: int) -> torch.Tensor:
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return ScaleGrad.apply(local, 1.0 / ep)


class ExpertParallelForward:
    """The forward of an ep-sharded MixtralExperts (same arguments and result as transformers' own)."""

    ep_group: dist.ProcessGroup
    ep_size: int
    num_experts: int

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        # Sort the (token, choice) pairs by expert: a stable order, so every run routes alike.
        order = torch.argsort(flat, stable=True)
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = self._exchange(hidden_states.index_select(0, token_of), counts)
        weights = top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(rows.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, (rows * weights).to(out.dtype))

    def _compute(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up = _local(self.gate_up_proj, self.ep_size).unbind(0)
        down = _local(self.down_proj, self.ep_size).unbind(0)
        if not tokens.shape[0]:
            # Keep every local expert, and the (empty) received rows, in the graph: every rank's backward then
            # reduces the same gradients and runs its collectives in the same order (hpkit.models.llama.moe says why).
            zero = sum(g.sum() for g in gate_up) + sum(d.sum() for d in down) + tokens.sum()
            return tokens.new_zeros((0, tokens.shape[-1])) + 0 * zero
        outs = []
        for e, part in enumerate(torch.split(tokens, counts)):
            if part.shape[0]:
                gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(self.act_fn(gate) * up, down[e]))
        return torch.cat(outs)

    def _exchange(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return exchange_with_experts(tokens, counts, self.ep_size, self.ep_group, self._compute)


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]


def apply_ep(model: nn.Module, ep_mesh, coords) -> int:
    ep = ep_mesh.size()
    found = _experts_modules(model)
    for experts in found:
        if experts.num_experts % ep:
            raise bad_config(
                f"expert_parallel_degree={ep} must divide the model's num_local_experts={experts.num_experts}"
            )
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            src = None if param.is_meta else 0
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=src)
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
        experts.ep_size = ep
        experts._hpkit_expert_mesh = coords.expert_fsdp_mesh
        base = type(experts)
        experts.__class__ = type(f"ExpertParallel{base.__name__}", (ExpertParallelForward, base), {})
    return len(found)
