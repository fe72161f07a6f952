"""`torch.sagemaker.distributed.checkpoint.state_dict_loader`: load."""

from hpkit.compat.smp_v2.checkpoint import load

__all__ = ["load"]
