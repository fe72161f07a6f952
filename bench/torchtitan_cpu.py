"""Start torchtitan 0.2.2's trainer on CPU/gloo without editing its source (used by bench_vs_torchtitan.py).

What stops 0.2.2 from training on a CPU-only host, each undone at run time:
- `torchtitan.tools.utils` picks its device at import time and falls back to "cuda" when no accelerator
  is found; torch's device probe is redirected to a CPU stand-in for that one import, then restored.
- it sets FSDP's gradient divide factor to 1.0, which FSDP2 turns into ReduceOp.PREMUL_SUM, and gloo
  has no PREMUL_SUM: force plain sums for those reductions (the factor is 1.0, so the result is equal).
- its profiler asks for the accelerator's activity, None on a CPU host, which torch.profiler rejects.
- its MoE router counts tokens per expert with torch.histc on the int64 expert indices, which torch
  implements for floating point only on CPU: count them as floats there and hand back integers, as CUDA's histc does.
- under expert parallel it permutes tokens with a Triton kernel unless asked for its own CPU
  implementation (generate_permute_indices(use_cpu=True)), which its caller never asks for.

Runs under torchtitan's own venv: `python -m torch.distributed.run ... bench/torchtitan_cpu.py <its flags>`.
"""

from __future__ import annotations

import types

import torch
import torch._utils as torch_utils


def _cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("cpu_device_stand_in")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    peak = {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}
    mod.current_device = lambda: 0
    mod.set_device = lambda *a, **k: None
    mod.device_count = lambda: 1
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=16 * 2**30, name="cpu")
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.empty_cache = lambda *a, **k: None
    mod.memory_stats = lambda *a, **k: dict(peak)
    mod.synchronize = lambda *a, **k: None
    return mod


def _import_torchtitan_on_cpu() -> None:
    stand_in = _cpu_device_module()
    saved = torch_utils._get_available_device_type, torch_utils._get_device_module
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device_type=None: (
        stand_in if device_type == "cpu" else saved[1](device_type)
    )
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = saved
    if tt_utils.device_type != "cpu":
        raise SystemExit(f"torchtitan_cpu: torchtitan chose device {tt_utils.device_type!r}, expected cpu")


def _sum_reductions_on_gloo() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_factor(self: FSDPModule, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor


def _profile_cpu_only() -> None:
    original = torch.profiler.profile

    def profile(*args, activities=None, **kwargs):
        activities = [a for a in activities or () if a is not None] or None
        return original(*args, activities=activities, **kwargs)

    torch.profiler.profile = profile


def _histc_of_integers_on_cpu() -> None:
    original = torch.histc

    def histc(values, bins=100, min=0, max=0, *, out=None):
        if values.device.type == "cpu" and not values.is_floating_point():
            # CUDA's histc of integers returns integers, which torchtitan then uses as sizes.
            return original(values.float(), bins=bins, min=min, max=max).to(values.dtype)
        return original(values, bins=bins, min=min, max=max, out=out)

    torch.histc = histc


def _permute_tokens_on_cpu() -> None:
    try:
        import torchtitan.models.moe.utils as moe_utils  # needs triton installed, even for its CPU path
    except ImportError:
        return  # a dense-only venv: nothing to permute
    original = moe_utils.generate_permute_indices

    def generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
        kwargs.setdefault("use_cpu", tokens_per_expert_group.device.type == "cpu")
        return original(tokens_per_expert_group, *args, **kwargs)

    moe_utils.generate_permute_indices = generate_permute_indices


if __name__ == "__main__":
    _import_torchtitan_on_cpu()
    _sum_reductions_on_gloo()
    _profile_cpu_only()
    _histc_of_integers_on_cpu()
    _permute_tokens_on_cpu()
    from torchtitan.train import Trainer, main

    main(Trainer)
