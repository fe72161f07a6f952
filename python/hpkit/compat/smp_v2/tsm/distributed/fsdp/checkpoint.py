"""`torch.sagemaker.distributed.fsdp.checkpoint`: the older save/load helpers."""

from hpkit.compat.smp_v2.legacy_checkpoint import (
    EXPORT_KEY_IDENTITY,
    EXPORT_KEY_MODEL,
    EXPORT_KEY_OPTIMIZER,
    EXPORT_KEY_SCHEDULER,
    load_model_checkpoint,
    save_model_checkpoint,
)

__all__ = [
    "EXPORT_KEY_IDENTITY",
    "EXPORT_KEY_MODEL",
    "EXPORT_KEY_OPTIMIZER",
    "EXPORT_KEY_SCHEDULER",
    "load_model_checkpoint",
    "save_model_checkpoint",
]
