"""SMP v2's `MoEConfig`: what the transform reads of it, and one line for what hpkit does not do."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class MoEConfig:
    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001

    def __post_init__(self) -> None:
        # Mixtral's own router (softmax top-k) routes here, and its aux loss comes from the model's config
        # (router_aux_loss_coef, output_router_logits): say once what the SMP-only options do not change.
        if dist.is_initialized() and dist.get_rank() == 0:
            print(
                f"tsm: MoEConfig: routing is the model's own (softmax top-k); moe_load_balancing="
                f"{self.moe_load_balancing!r} and moe_z_loss_coeff are not applied, use the model config's "
                "router_aux_loss_coef",
                file=sys.stderr,
                flush=True,
            )
