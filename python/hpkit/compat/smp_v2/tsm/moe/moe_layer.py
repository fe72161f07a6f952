"""`torch.sagemaker.moe.moe_layer.MoELayer`: a transformed model's sparse MoE block."""

from hpkit.compat.smp_v2.layers import MoELayer

__all__ = ["MoELayer"]
