"""`torch.sagemaker.tensor_parallel.transformer.TransformerLayer`: what auto-wrap policies name."""

from hpkit.compat.smp_v2.layers import TransformerLayer

__all__ = ["TransformerLayer"]
