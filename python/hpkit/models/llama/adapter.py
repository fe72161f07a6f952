"""The Llama family's adapter: hpkit.models.llama.model built, split, tensor-parallelised and converted.

Tensor parallel (Megatron-style): attention and MLP are column- then row-parallel. With sequence parallel
the norms and the residual stream run sharded along the sequence between blocks, as torchtitan does: each
row-parallel output is reduce-scattered and each block input all-gathered, which moves the bytes of one
all-reduce and keeps 1/tp of the activations. Without it (the default on CPU, see
`tensor_parallel.sequence_parallel_default`) the residual stream stays whole and each row-parallel output
is all-reduced.

Chosen modules only (SMP's set_tensor_parallelism on some modules): the chosen attention/MLP units are
column/row parallel and hand back ordinary replicated tensors, so they can sit next to modules that are not
parallelised; no sequence parallel then, because the residual stream stays whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from hpkit.errors import SpecError
from hpkit.layout_rules.parallel import tp_problem
from hpkit.models.adapter import ModelAdapter
from hpkit.models.llama import hf_format
from hpkit.models.llama import model as llama
from hpkit.models.llama.shape import ModelShape
from hpkit.models.tp_styles import ReplicateParallel


class LlamaAdapter(ModelAdapter):
    family = "llama"
    hf = hf_format.LLAMA

    # ---- configuration ---------------------------------------------------------------------------

    def config(self, shape: ModelShape) -> llama.LlamaConfig:
        return llama.config_of_shape(shape)

    def config_to_dict(self, cfg: llama.LlamaConfig) -> dict[str, Any]:
        return llama.config_to_dict(cfg)

    def config_from_dict(self, data: dict[str, Any]) -> llama.LlamaConfig:
        return llama.config_from_dict(data)

    def num_params(self, cfg: llama.LlamaConfig) -> int:
        return cfg.num_params()

    def flops_per_token(self, cfg: llama.LlamaConfig, seq_len: int) -> float:
        return cfg.flops_per_token(seq_len)

    # ---- the module ------------------------------------------------------------------------------

    def build(self, cfg: llama.LlamaConfig, device: torch.device | str = "meta") -> nn.Module:
        return llama.build_model(cfg, device)

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, llama.Llama) and model.cfg.moe is None

    def init_weights(self, model: nn.Module, seed: int) -> None:
        model.init_weights(seed)

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.layers

    def input_units(self, model: nn.Module) -> list[nn.Module]:
        return [model.tok_embeddings] if model.tok_embeddings is not None else []

    def output_units(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in (model.norm, model.output) if m is not None]

    # ---- pipeline parallel -------------------------------------------------------------------------

    def keep_stage(self, part: nn.Module, blocks: list[int], first: bool, last: bool) -> nn.Module:
        keep = {str(i) for i in blocks}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if not first:
            part.tok_embeddings = None
        if not last:
            part.norm = None
            part.output = None
        return part

    # ---- tensor parallel ---------------------------------------------------------------------------

    def tp_units(self, model: nn.Module) -> list[str]:
        units = [n for n in ("tok_embeddings", "output") if getattr(model, n, None) is not None]
        for idx in model.layers:
            units += [f"layers.{idx}.attention", f"layers.{idx}.feed_forward"]
        return units

    def check_tp(
        self, model: nn.Module, tp: int, seq_len: int, whole_model: bool, sequence_parallel: bool
    ) -> None:
        cfg = model.cfg
        if problem := tp_problem(
            tp,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            ffn_dim=cfg.ffn_dim,
            vocab_size=cfg.vocab_size,
            seq_len=seq_len,
            whole_model=whole_model,
            sequence_parallel=sequence_parallel,
        ):
            raise SpecError(problem)

    def apply_tp(
        self,
        model: nn.Module,
        tp_mesh: DeviceMesh,
        units: list[str] | None,
        loss_parallel: bool,
        sequence_parallel: bool,
    ) -> None:
        if units is None:
            _whole_model_tp(model, tp_mesh, loss_parallel, sequence_parallel, self.ffn_tp_plan)
            return
        plan: dict[str, object] = {}
        for unit in units:
            leaf = unit.rsplit(".", 1)[-1]
            if leaf == "attention":
                plan |= {f"{unit}.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
                plan[f"{unit}.wo"] = RowwiseParallel()
            elif leaf == "feed_forward":
                plan |= {f"{unit}.w1": ColwiseParallel(), f"{unit}.w3": ColwiseParallel()}
                plan[f"{unit}.w2"] = RowwiseParallel()
            elif unit == "tok_embeddings":
                plan[unit] = RowwiseParallel(input_layouts=Replicate())
            elif unit == "output":
                plan[unit] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, tp_mesh, plan)

    def ffn_tp_plan(
        self, block: nn.Module, stream: Placement, norm: ParallelStyle
    ) -> dict[str, ParallelStyle]:
        """A block's FFN under whole-model TP (its input arrives in the `stream` layout and leaves in it):
        SwiGLU's w1/w3 column-parallel, w2 row-parallel."""
        return {
            "ffn_norm": norm,
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            "feed_forward.w3": ColwiseParallel(),
        }


def _whole_model_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    sequence_parallel: bool,
    ffn_plan: Callable[[nn.Module, Placement, ParallelStyle], dict[str, ParallelStyle]],
) -> None:
    # The residual stream between blocks is sequence-sharded under sequence parallel, else a plain tensor,
    # whole and equal on every TP rank. A pipeline stage may lack embeddings or the head, so stage
    # boundaries carry the same layout. Each block's attention and MLP turn their input into one DTensor
    # that the column-parallel projections share, so the backward sums their partial input gradients once.
    stream = Shard(1) if sequence_parallel else Replicate()

    def norm() -> ParallelStyle:
        return SequenceParallel() if sequence_parallel else ReplicateParallel()

    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None:
        top["norm"] = norm()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": norm(),
                "attention": PrepareModuleInput(
                    input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=stream),
                **ffn_plan(block, stream, norm()),
            },
        )
