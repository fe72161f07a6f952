"""`torch.sagemaker.distributed.checkpoint.state_dict_saver`: save, async_save, maybe_finalize_async_calls."""

from hpkit.compat.smp_v2.checkpoint import async_save, maybe_finalize_async_calls, save

__all__ = ["async_save", "maybe_finalize_async_calls", "save"]
