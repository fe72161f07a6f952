"""Storage: a filesystem every node shares (FSx for Lustre on HyperPod) for code, data and checkpoints, and
free space where checkpoints and caches land."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hpkit.checks.context import Context
from hpkit.checks.mounts import SHARED_FS_TYPES, Mount, mount_of, read_mounts
from hpkit.checks.registry import check
from hpkit.checks.result import Result

ALL = ("login", "compute", "container")
# Disk filesystems whose mount points are a node's layout (/, /opt/dlami/nvme, /scratch): a node
# missing one is set up differently from its peers.
LOCAL_DISK_TYPES = frozenset({"ext4", "xfs", "btrfs", "zfs", "ext3"})
# Mounts that container runtimes and kubelet make per container or pod: they differ from node to node
# without saying anything about the node.
_PER_CONTAINER = ("/var/lib/docker/", "/var/lib/containers/", "/var/lib/kubelet/", "/run/")
DISK_WARN_GIB = 20
DISK_FAIL_GIB = 2

_FIX_SHARED = (
    "mount the cluster's shared filesystem (HyperPod: FSx for Lustre at /fsx via the lifecycle scripts' "
    "`mount_fsx` step; in a container add `--container-mounts=/fsx:/fsx`), or name it with `--shared-fs PATH`"
)


@check("shared-fs", "Shared filesystem mounted", profiles=ALL)
def shared_fs(ctx: Context) -> Result:
    mounts = read_mounts(ctx.roots.proc)
    if mounts is None:
        return Result.fail("cannot read /proc/self/mountinfo", "run the check where /proc is mounted")
    shared = sorted({f"{m.mount_point} ({m.fstype})" for m in mounts if m.fstype in SHARED_FS_TYPES})
    local = sorted(
        {
            f"{m.mount_point} ({m.fstype})"
            for m in mounts
            if m.fstype in LOCAL_DISK_TYPES and not m.mount_point.startswith(_PER_CONTAINER)
        }
    )
    return _shared_fs_verdict(ctx, mounts).with_facts(shared_mounts=shared, local_mounts=local)


def _shared_fs_verdict(ctx: Context, mounts: list[Mount]) -> Result:
    if ctx.shared_fs is not None:
        wanted = str(ctx.shared_fs).rstrip("/") or "/"
        mount = mount_of(wanted, mounts)
        if not ctx.shared_fs.exists():
            return Result.fail(f"{wanted} does not exist", _FIX_SHARED)
        if mount is None or mount.fstype not in SHARED_FS_TYPES:
            kind = mount.fstype if mount else "unknown"
            return Result.fail(
                f"{wanted} is on a node-local {kind} filesystem ({mount.mount_point if mount else '?'}): "
                "other nodes do not see what is written there",
                _FIX_SHARED,
            )
        return Result.ok(f"{wanted} is on {mount.fstype} ({mount.source} at {mount.mount_point})")
    shared = [m for m in mounts if m.fstype in SHARED_FS_TYPES]
    if not shared:
        return Result.fail("no shared filesystem (Lustre, NFS, EFS, …) is mounted", _FIX_SHARED)
    # Lustre first: on HyperPod that is FSx, the one meant for training data and checkpoints.
    shared.sort(key=lambda m: (m.fstype != "lustre", m.mount_point))
    shown = ", ".join(f"{m.mount_point} ({m.fstype})" for m in shared[:3])
    return Result.ok(shown + (f" and {len(shared) - 3} more" if len(shared) > 3 else ""))


@check("disk", "Free disk space", profiles=ALL)
def disk(ctx: Context) -> Result:
    paths = ctx.disk_paths
    if paths is None:
        paths = (
            Path(ctx.env.get("HOME", str(Path.home()))),
            Path(ctx.env.get("TMPDIR") or tempfile.gettempdir()),
        )
    seen: dict[str, float] = {}
    for path in paths:
        try:
            seen[str(path)] = shutil.disk_usage(path).free / 2**30
        except OSError as exc:
            return Result.fail(
                f"cannot measure {path}: {exc.strerror or exc}", f"create {path} or fix its permissions"
            )
    shown = "; ".join(f"{p} {gib:.1f} GiB free" for p, gib in seen.items())
    fix = (
        "free space (old checkpoints, `enroot remove`, ~/.cache/pip) or point TMPDIR and the checkpoint folder at "
        "a larger disk (/opt/dlami/nvme or /fsx on HyperPod)"
    )
    if min(seen.values()) < DISK_FAIL_GIB:
        return Result.fail(shown, fix)
    if min(seen.values()) < DISK_WARN_GIB:
        return Result.warn(shown + f" (under {DISK_WARN_GIB} GiB)", fix)
    return Result.ok(shown)
