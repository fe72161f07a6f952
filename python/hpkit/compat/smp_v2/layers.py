"""SMP v2's layer classes, which scripts name in auto-wrap policies and activation-checkpoint checks.

After `tsm.transform`, SMP's model is built from `TransformerLayer` (and `MoELayer`) instances. Here the model
keeps its Hugging Face classes, so these two classes answer isinstance for the layers the transform marked:
`transformer_auto_wrap_policy(transformer_layer_cls={TransformerLayer})` and `check_fn=lambda m:
isinstance(m, TransformerLayer)` then find the decoder layers, instead of silently finding nothing.
"""

from __future__ import annotations

from torch import nn

_LAYER = "_hpkit_tsm_layer"
_MOE = "_hpkit_tsm_moe"


class _Marked(type):
    attribute = ""

    def __instancecheck__(cls, instance: object) -> bool:
        return bool(getattr(instance, cls.attribute, False)) or type.__instancecheck__(cls, instance)


class _LayerMeta(_Marked):
    attribute = _LAYER


class _MoEMeta(_Marked):
    attribute = _MOE


class TransformerLayer(nn.Module, metaclass=_LayerMeta):
    """A decoder layer of a transformed model (isinstance is true for the model's own layer class)."""


class MoELayer(nn.Module, metaclass=_MoEMeta):
    """A transformed model's sparse MoE block."""


def mark(model: nn.Module, decoder_layers: list[nn.Module]) -> None:
    for layer in decoder_layers:
        setattr(layer, _LAYER, True)
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if block is not None and hasattr(block, "experts") and hasattr(block, "gate"):
            setattr(block, _MOE, True)
