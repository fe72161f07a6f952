"""Expert parallel: each MoE block's routed experts are split over the ep mesh dimension, E / ep per rank.

The experts' 3-D weights become DTensors sharded along dim 0 (the expert index) on the ep mesh, so each
rank allocates only its experts and a checkpoint still holds one [E, ...] tensor per weight, which DCP
reshards to any other ep degree. The experts' forward then exchanges tokens with all-to-all over the ep
group (hpkit.models.llama.moe.GroupedExperts).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from hpkit.errors import SpecError
from hpkit.layout_rules.parallel import ep_problem
from hpkit.models.adapters import ModelAdapter, adapter_of


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, adapter: ModelAdapter | None = None) -> int:
    """Shard every routed-expert module of `model` over `ep_mesh`; returns how many it sharded."""
    ep = ep_mesh.size()
    experts_modules = (adapter or adapter_of(model)).expert_modules(model)
    for experts in experts_modules:
        if problem := ep_problem(ep, experts.n_experts):
            raise SpecError(problem)
        for name, param in list(experts.named_parameters(recurse=False)):
            # The model is still on the meta device: nothing is copied, each rank keeps its slice's shape.
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
        experts.ep_size = ep
    return len(experts_modules)
