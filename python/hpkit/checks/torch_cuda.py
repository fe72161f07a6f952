"""PyTorch, CUDA, the NVIDIA driver and the GPUs, read from files and metadata: nothing here imports torch or
initialises CUDA (either would cost seconds, and CUDA initialisation can hang on a sick GPU)."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from hpkit.checks.context import Context
from hpkit.checks.instance_types import expected_for
from hpkit.checks.probe import at_least, distributions, fmt_version, parse_version, read_text
from hpkit.checks.registry import check
from hpkit.checks.result import Result

MIN_TORCH = (2, 0, 1)
MIN_CUDA = (11, 8)
GPU_PROFILES = ("compute", "container")

_FIX_TORCH = (
    "install a CUDA build of PyTorch ≥ 2.0.1 into the training environment, e.g. "
    "`pip install torch --index-url https://download.pytorch.org/whl/cu121` (or `pip install -e '.[train]'` "
    "with the CUDA wheel index), or use an image built from docker/Dockerfile"
)


@dataclass(frozen=True)
class TorchInstall:
    version: str
    location: str
    cuda: str | None  # the CUDA runtime torch was built with; None for a CPU build


def find_torch(ctx: Context) -> TorchInstall | None:
    def find() -> TorchInstall | None:
        for dist in distributions(ctx.search_path, "torch"):
            version_py = Path(str(dist.locate_file("torch/version.py")))
            text = read_text(version_py) or ""
            match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
            return TorchInstall(dist.version, str(version_py.parent), match.group(1) if match else None)
        return None

    return ctx.memo("torch", find)


@check("torch", "PyTorch ≥ 2.0.1", profiles=GPU_PROFILES)
def torch_version(ctx: Context) -> Result:
    torch = find_torch(ctx)
    return _torch_verdict(torch).with_facts(torch=torch.version if torch else None)


def _torch_verdict(torch: TorchInstall | None) -> Result:
    if torch is None:
        return Result.fail("PyTorch is not installed in this Python environment", _FIX_TORCH)
    found = parse_version(torch.version)
    if found is None or not at_least(found, MIN_TORCH):
        return Result.fail(f"PyTorch {torch.version} at {torch.location}; need ≥ 2.0.1", _FIX_TORCH)
    return Result.ok(f"PyTorch {torch.version} at {torch.location}")


def driver_version(ctx: Context) -> str | None:
    """The kernel module's version, e.g. '535.104.05', from /proc/driver/nvidia/version."""
    text = read_text(ctx.roots.proc / "driver" / "nvidia" / "version")
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text or "")
    return match.group(1) if match else None


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA the installed driver supports, from libcuda's cuDriverGetVersion (needs no cuInit)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(value)) != 0 or value.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return value.value // 1000, (value.value % 1000) // 10


@check("cuda", "CUDA runtime ≥ 11.8", profiles=GPU_PROFILES)
def cuda_runtime(ctx: Context) -> Result:
    torch = find_torch(ctx)
    return _cuda_verdict(torch).with_facts(cuda=torch.cuda if torch else None)


def _cuda_verdict(torch: TorchInstall | None) -> Result:
    if torch is None:
        return Result.skip("PyTorch is not installed (see the torch check)", _FIX_TORCH)
    if torch.cuda is None:
        return Result.fail(f"PyTorch {torch.version} is a CPU-only build: no CUDA runtime", _FIX_TORCH)
    found = parse_version(torch.cuda)
    if found is None or not at_least(found, MIN_CUDA):
        return Result.fail(
            f"PyTorch {torch.version} was built with CUDA {torch.cuda}; need ≥ 11.8", _FIX_TORCH
        )
    return Result.ok(f"PyTorch {torch.version} was built with CUDA {torch.cuda}")


_FIX_DRIVER = (
    "on a GPU host use the HyperPod/Deep Learning AMI or install the NVIDIA driver (`nvidia-smi` must work); "
    "in a container, run it with the GPUs passed through (`docker run --gpus all`; with pyxis/enroot the "
    "nvidia hook does it when NVIDIA_VISIBLE_DEVICES is set)"
)


@check("nvidia-driver", "NVIDIA driver supports the CUDA runtime", profiles=GPU_PROFILES)
def nvidia_driver(ctx: Context) -> Result:
    version = driver_version(ctx)
    return _driver_verdict(ctx, version).with_facts(driver=version)


def _driver_verdict(ctx: Context, version: str | None) -> Result:
    if version is None:
        return Result.fail("no NVIDIA kernel driver is loaded (no /proc/driver/nvidia/version)", _FIX_DRIVER)
    supports = driver_cuda_version()
    torch = find_torch(ctx)
    runtime = parse_version(torch.cuda) if torch and torch.cuda else None
    if supports is None:
        return Result.warn(
            f"driver {version}; libcuda.so.1 could not be loaded to ask which CUDA it supports",
            "put libcuda.so.1 on the loader path (the driver's user-space library; in containers the nvidia "
            "hook mounts it)",
        )
    shown = f"driver {version} supports CUDA ≤ {fmt_version(supports)}"
    if runtime is None or at_least(supports, runtime[:2]):
        return Result.ok(shown + (f"; PyTorch uses CUDA {fmt_version(runtime)}" if runtime else ""))
    fix = "upgrade the NVIDIA driver, or install a PyTorch build for an older CUDA"
    if runtime[0] > supports[0]:
        return Result.fail(f"{shown}, but PyTorch needs CUDA {fmt_version(runtime)}", fix)
    return Result.warn(
        f"{shown}, older than PyTorch's CUDA {fmt_version(runtime)}: only minor-version compatibility "
        "(PTX JIT and newer APIs fail)",
        fix,
    )


def gpu_models(ctx: Context) -> list[str]:
    """One model name per GPU the driver sees, from /proc/driver/nvidia/gpus/<pci>/information."""
    folder = ctx.roots.proc / "driver" / "nvidia" / "gpus"
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    models = []
    for entry in entries:
        match = re.search(r"^Model:\s*(.+)$", read_text(entry / "information") or "", re.MULTILINE)
        models.append(match.group(1).strip() if match else "unknown model")
    return models


@check("gpus", "GPU count", profiles=GPU_PROFILES)
def gpu_count(ctx: Context) -> Result:
    models = gpu_models(ctx)
    model = ", ".join(sorted(set(models))) or None
    return _gpu_verdict(ctx, models).with_facts(gpu_count=len(models), gpu_model=model)


def _gpu_verdict(ctx: Context, models: list[str]) -> Result:
    instance_type, spec = expected_for(ctx)
    visible = ctx.env.get("CUDA_VISIBLE_DEVICES")
    note = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if not models:
        return Result.fail(
            "the NVIDIA driver sees no GPU (/proc/driver/nvidia/gpus is empty or missing)", _FIX_DRIVER
        )
    shown = f"{len(models)} × {sorted(set(models))[0] if len(set(models)) == 1 else ', '.join(sorted(set(models)))}"
    if spec is None:
        return Result.ok(f"{shown}{note}; instance type unknown, nothing to compare with")
    if len(models) < spec.gpus:
        return Result.fail(
            f"{shown}{note}, but {instance_type} has {spec.gpus}: a GPU fell off the bus or was not passed in",
            "check `nvidia-smi` and `dmesg | grep -i xid`; on HyperPod replace the node: `scontrol update "
            'node=NAME state=fail reason="Action:Replace"`',
        )
    if len(models) > spec.gpus:
        return Result.warn(
            f"{shown}{note}, more than the {spec.gpus} of {instance_type}",
            "check hpkit's instance table (python/hpkit/catalog.py) for this type",
        )
    return Result.ok(f"{shown}{note}, as expected on {instance_type}")
