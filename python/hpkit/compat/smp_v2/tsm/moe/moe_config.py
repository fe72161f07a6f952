"""`torch.sagemaker.moe.moe_config.MoEConfig`, passed to `tsm.transform(model, config=...)`."""

from hpkit.compat.smp_v2.moe_config import MoEConfig

__all__ = ["MoEConfig"]
