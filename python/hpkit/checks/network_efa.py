"""The inter-node path: NCCL, the aws-ofi-nccl plugin that lets NCCL use libfabric, and EFA devices with
libfabric's efa provider. Versions come from package metadata and file names; nothing loads NCCL."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from hpkit.checks.context import Context
from hpkit.checks.instance_types import expected_for
from hpkit.checks.probe import distributions, read_text, run_cmd, which
from hpkit.checks.registry import check
from hpkit.checks.result import Result

PROFILES = ("compute", "container")
# PyTorch's CUDA wheels bring NCCL as one of these.
NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
_NCCL_FILE = re.compile(r"^libnccl\.so\.(\d+\.\d+\.\d+)$")
# aws-ofi-nccl ≥ 1.7 installs libnccl-net-ofi.so as well; NCCL looks for libnccl-net.so unless
# NCCL_NET_PLUGIN names another.
_PLUGIN_FILES = ("libnccl-net.so", "libnccl-net-ofi.so", "libnccl-net-aws-ofi.so")


def _env_dirs(ctx: Context, name: str) -> list[Path]:
    return [Path(part) for part in ctx.env.get(name, "").split(":") if part]


def _ld_conf_dirs(ctx: Context) -> list[Path]:
    """Folders the dynamic loader searches by configuration (ld.so.conf and its .d files)."""
    dirs: list[Path] = []
    conf_files = [ctx.roots.etc / "ld.so.conf"]
    with contextlib.suppress(OSError):
        conf_files += sorted((ctx.roots.etc / "ld.so.conf.d").glob("*.conf"))
    for conf in conf_files:
        for line in (read_text(conf) or "").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("/"):
                dirs.append(ctx.roots.inside(line))
    return dirs


def _system_nccl_dirs(ctx: Context) -> list[Path]:
    opt = ctx.roots.opt
    return [
        *_env_dirs(ctx, "LD_LIBRARY_PATH"),
        *([Path(ctx.env["NCCL_HOME"]) / "lib"] if ctx.env.get("NCCL_HOME") else []),
        opt / "nccl" / "build" / "lib",
        opt / "amazon" / "nccl" / "lib",
        *_ld_conf_dirs(ctx),
        ctx.roots.usr / "lib" / "x86_64-linux-gnu",
        ctx.roots.usr / "lib" / "aarch64-linux-gnu",
        ctx.roots.usr / "local" / "lib",
    ]


def _nccl_files(dirs: list[Path]) -> Iterator[tuple[str, Path]]:
    for folder in dirs:
        try:
            names = sorted(p.name for p in folder.iterdir())
        except OSError:
            continue
        for name in names:
            match = _NCCL_FILE.match(name)
            if match:
                yield match.group(1), folder / name


_FIX_NCCL = (
    "install a CUDA build of PyTorch (it brings NCCL as the nvidia-nccl-cu12 wheel), or NCCL itself "
    "(the EFA/DLAMI images have it under /opt/nccl); see docker/Dockerfile"
)


@check("nccl", "NCCL", profiles=PROFILES)
def nccl(ctx: Context) -> Result:
    found = []
    versions: set[str] = set()
    for wheel in NCCL_WHEELS:
        for dist in distributions(ctx.search_path, wheel):
            found.append(f"NCCL {dist.version} ({wheel}, used by PyTorch)")
            versions.add(dist.version)
    seen = set()
    for version, path in _nccl_files(_system_nccl_dirs(ctx)):
        if path.parent not in seen:
            seen.add(path.parent)
            found.append(f"NCCL {version} at {path}")
            versions.add(version)
    facts = {"nccl": sorted(versions)}
    if not found:
        return Result.fail(
            "no NCCL found: no nvidia-nccl-* wheel and no libnccl.so.X.Y.Z on the library path", _FIX_NCCL
        ).with_facts(**facts)
    return Result.ok("; ".join(found)).with_facts(**facts)


_FIX_OFI = (
    "install aws-ofi-nccl (the EFA installer on the DLAMI puts it in /opt/amazon/ofi-nccl) and put its lib "
    "folder on LD_LIBRARY_PATH, e.g. `export LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:$LD_LIBRARY_PATH`; "
    "without it NCCL falls back to TCP sockets"
)


@check("aws-ofi-nccl", "aws-ofi-nccl plugin", profiles=PROFILES)
def aws_ofi_nccl(ctx: Context) -> Result:
    loader_dirs = _env_dirs(ctx, "LD_LIBRARY_PATH") + _ld_conf_dirs(ctx)
    opt = ctx.roots.opt
    install_dirs = [
        opt / "amazon" / "ofi-nccl" / "lib",
        opt / "amazon" / "ofi-nccl" / "lib64",
        opt / "amazon" / "ofi-nccl" / "lib" / "x86_64-linux-gnu",
        opt / "aws-ofi-nccl" / "lib",
        opt / "amazon" / "aws-ofi-nccl" / "lib",
    ]
    plugin = ctx.env.get("NCCL_NET_PLUGIN", "")
    names = list(_PLUGIN_FILES)
    if plugin and "/" not in plugin:
        names.insert(0, f"libnccl-net-{plugin}.so")
    elif plugin:
        names.insert(0, Path(plugin).name)
        loader_dirs.insert(0, Path(plugin).parent)
    for folder in loader_dirs:
        for name in names:
            if (folder / name).exists():
                return Result.ok(f"{folder / name} (on the loader path)")
    for folder in install_dirs:
        for name in names:
            if (folder / name).exists():
                return Result.warn(
                    f"{folder / name} is installed but not on LD_LIBRARY_PATH or ld.so.conf: NCCL will not load it",
                    f"`export LD_LIBRARY_PATH={folder}:$LD_LIBRARY_PATH` in the job (and pass it into the container)",
                )
    return Result.fail("no aws-ofi-nccl plugin (libnccl-net*.so) on the loader path or under /opt", _FIX_OFI)


def efa_devices(ctx: Context) -> list[str]:
    """EFA devices: /sys/class/infiniband entries whose driver is efa."""
    folder = ctx.roots.sys / "class" / "infiniband"
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        driver = entry / "device" / "driver"
        try:
            name = driver.resolve().name if driver.exists() else ""
        except OSError:
            name = ""
        if name == "efa" or (not name and entry.name.startswith(("rdmap", "efa"))):
            found.append(entry.name)
    return found


_FIX_EFA = (
    "launch the instances with EFA interfaces (HyperPod does this for EFA-capable types) and install the EFA "
    "software (`sudo ./efa_installer.sh -y`); in a container pass the devices in (`--device /dev/infiniband`, "
    "pyxis does it) and install libfabric in the image"
)


@check("efa", "EFA devices and libfabric efa provider", profiles=PROFILES)
def efa(ctx: Context) -> Result:
    devices = efa_devices(ctx)
    return _efa_verdict(ctx, devices).with_facts(efa_count=len(devices))


def _efa_verdict(ctx: Context, devices: list[str]) -> Result:
    instance_type, spec = expected_for(ctx)
    expected = spec.efa_devices if spec else None
    if not devices:
        if expected == 0:
            return Result.warn(f"no EFA on {instance_type}: NCCL will use TCP", "use an EFA-capable type")
        return Result.fail("no EFA device in /sys/class/infiniband", _FIX_EFA)
    shown = f"{len(devices)} EFA device(s) ({', '.join(devices[:4])}{', …' if len(devices) > 4 else ''})"
    fi_info = which("fi_info", ctx.env, [ctx.roots.opt / "amazon" / "efa" / "bin"])
    if fi_info is None:
        return Result.warn(f"{shown}, but libfabric's fi_info is not installed", _FIX_EFA)
    ran = run_cmd([fi_info, "-p", "efa"], ctx.probe_timeout, ctx.env)
    if not ran.ok or "efa" not in ran.out:
        return Result.fail(f"{shown}, but `fi_info -p efa` finds no efa provider: {ran.why()}", _FIX_EFA)
    if expected is not None and len(devices) < expected:
        return Result.warn(
            f"{shown}; {instance_type} has {expected}: collectives run at a fraction of the bandwidth",
            "check that every network card got an EFA interface (HyperPod: replace the node)",
        )
    return Result.ok(f"{shown}; libfabric efa provider present")
