"""`torch.sagemaker.grad_norm.clip_grad_norm_(model, max_norm)`: the norm over every mesh, and clipping."""

from hpkit.compat.smp_v2.fsdp import clip_grad_norm as clip_grad_norm_

__all__ = ["clip_grad_norm_"]
