"""`DelayedParamIniter`: the model was built on the meta device; FSDP materialises it module by module."""

from hpkit.compat.smp_v2.delayed import DelayedParamIniter

__all__ = ["DelayedParamIniter"]
