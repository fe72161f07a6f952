"""The mixture-of-experts family's adapter: Llama blocks whose FFN is hpkit.models.llama.moe.MoE in every
`moe.every`-th block. Everything but the FFN is Llama's, so this adapter is Llama's with three changes:
the configuration carries `model.moe`, FSDP and expert parallel find the experts, and tensor parallel
runs a MoE block's FFN replicated on the tp ranks.

Why replicated under TP: the experts are already split by expert parallel, and splitting each expert's
matrices again over tp (torchtitan's ETP) would add two collectives per expert per block for matrices
this small. The router and the shared experts become Replicate DTensors on the tp mesh (every parameter
of a block then lives on one mesh, as FSDP and the fused optimizer want); the routed experts stay on the
ep mesh.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Placement, Replicate
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from torch.distributed.tensor.parallel.style import ParallelStyle

from hpkit.models.llama import hf_format
from hpkit.models.llama import model as llama
from hpkit.models.llama.adapter import LlamaAdapter
from hpkit.models.llama.moe import MoE
from hpkit.models.tp_styles import ReplicateParallel


class MoEAdapter(LlamaAdapter):
    family = "moe"
    hf = hf_format.MIXTRAL  # MixtralForCausalLM: loads (model.init_from); export is not written yet

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, llama.Llama) and model.cfg.moe is not None

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m.experts for m in model.modules() if isinstance(m, MoE)]

    def tp_units(self, model: nn.Module) -> list[str]:
        # A MoE block's FFN is not a tensor-parallel unit (see the module docstring).
        return [u for u in super().tp_units(model) if not self._is_moe_ffn(model, u)]

    @staticmethod
    def _is_moe_ffn(model: nn.Module, unit: str) -> bool:
        return unit.endswith("feed_forward") and isinstance(model.get_submodule(unit), MoE)

    def ffn_tp_plan(
        self, block: nn.Module, stream: Placement, norm: ParallelStyle
    ) -> dict[str, ParallelStyle]:
        ffn = block.feed_forward
        if not isinstance(ffn, MoE):
            return super().ffn_tp_plan(block, stream, norm)
        plan: dict[str, ParallelStyle] = {
            "ffn_norm": norm,
            # Every tp rank routes the whole (replicated) token set: plain tensors in, the stream layout out.
            "feed_forward": PrepareModuleInputOutput(
                input_layouts=(stream,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(stream,),
                use_local_output=True,
            ),
            "feed_forward.router.gate": ReplicateParallel(),
        }
        if ffn.shared is not None:
            plan |= {f"feed_forward.shared.{w}": ReplicateParallel() for w in ("w1", "w2", "w3")}
        return plan
