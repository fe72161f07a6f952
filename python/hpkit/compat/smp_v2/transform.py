"""`tsm.transform(model)`: torch-native tensor parallel and expert parallel on the Hugging Face classes SMP v2
supports, planned per class, never guessed.

TP: DTensor Colwise/Rowwise plans on each decoder layer's attention and dense MLP (the projections SMP v2's own
TP shards), on the state's tp mesh. Heads are split across tp ranks, so a class is planned only where its
attention reshapes by head size (`view(..., -1, head_dim)`), which the classes in PLANS do. EP: Mixtral's
experts (3-D weights) are split over the ep mesh, E / ep per rank, and tokens reach them by all-to-all
(hpkit.compat.smp_v2.experts). A class with no plan stops the job in one line when TP or EP is asked for.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hpkit.compat.smp_v2 import layers
from hpkit.compat.smp_v2.state import bad_config, require

_LLAMA_LIKE = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
_MIXTRAL_ATTENTION = {k: v for k, v in _LLAMA_LIKE.items() if k.startswith("self_attn")}
_NEOX = {
    # query_key_value is laid out head by head ([heads][q, k, v][head_size]), so a column split is a head split.
    "attention.query_key_value": "colwise",
    "attention.dense": "rowwise",
    "mlp.dense_h_to_4h": "colwise",
    "mlp.dense_4h_to_h": "rowwise",
}
# model_type -> (the decoder layer's plan, the config's head counts that tp must divide)
PLANS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "llama": (_LLAMA_LIKE, ("num_attention_heads", "num_key_value_heads")),
    "mistral": (_LLAMA_LIKE, ("num_attention_heads", "num_key_value_heads")),
    "mixtral": (_MIXTRAL_ATTENTION, ("num_attention_heads", "num_key_value_heads")),
    "gpt_neox": (_NEOX, ("num_attention_heads",)),
}
EXPERT_TYPES = ("mixtral",)


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "") or type(model).__name__)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    for name in ("model", "gpt_neox", "transformer"):
        inner = getattr(model, name, None)
        if inner is not None and isinstance(getattr(inner, "layers", None), nn.ModuleList):
            return list(inner.layers)
    if isinstance(getattr(model, "layers", None), nn.ModuleList):
        return list(model.layers)
    return []


def _style(kind: str) -> Any:
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def apply_tp(model: nn.Module, model_type: str, tp_mesh) -> int:
    plan, head_fields = PLANS[model_type]
    tp = tp_mesh.size()
    config = model.config
    for field in head_fields:
        heads = getattr(config, field, None) or config.num_attention_heads
        if heads % tp:
            raise bad_config(
                f"tensor_parallel_degree={tp} must divide the model's {field}={heads}: each tp rank holds "
                "whole heads",
                "tsm.transform",
            )
    decoder = _decoder_layers(model)
    for layer in decoder:
        parallelize_module(layer, tp_mesh, {path: _style(kind) for path, kind in plan.items()})
    return len(decoder)


def transform(
    model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    load_state_dict_from_rank0: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """SMP v2's transform: the model, tensor- and expert-parallel as `tsm.init` configured, in place."""
    state = require()
    model_type = _model_type(model)
    tp_mesh, ep_mesh = state.coords.tp_mesh, state.coords.ep_mesh
    if kwargs and dist.get_rank() == 0:
        names = ", ".join(sorted(kwargs))
        print(f"tsm: warning: transform({names}=...) is ignored by hpkit's SMP v2 layer", file=sys.stderr)
    if (tp_mesh is not None or ep_mesh is not None) and model_type not in PLANS:
        raise bad_config(
            f"tensor or expert parallel is asked for, but {type(model).__name__} ({model_type}) has no plan here: "
            f"hpkit plans {', '.join(sorted(PLANS))}; set tensor_parallel_degree and expert_parallel_degree to 1",
            "tsm.transform",
        )
    if dtype is not None:
        model.to(dtype=dtype)
    if tp_mesh is not None:
        apply_tp(model, model_type, tp_mesh)
    if ep_mesh is not None:
        if model_type not in EXPERT_TYPES:
            raise bad_config(
                f"expert_parallel_degree={state.expert_parallel_degree} needs a mixture of experts; "
                f"{type(model).__name__} has none: set expert_parallel_degree to 1",
                "tsm.transform",
            )
        from hpkit.compat.smp_v2.experts import apply_ep

        apply_ep(model, ep_mesh, state.coords)
    layers.mark(model, _decoder_layers(model))
    if state.sm_activation_offloading:
        _offload_activations(model)
    model._hpkit_tsm_transformed = True
    return model


def _offload_activations(model: nn.Module) -> None:
    """sm_activation_offloading: what the forward saves for backward waits in host memory (torch's save_on_cpu)."""
    forward = model.forward

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return forward(*args, **kwargs)

    model.forward = offloaded
