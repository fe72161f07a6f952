"""Inside the training container: it is the image, not the host (srun may ignore the container silently); SMDDP writes
to the host's /var/log, so it must be a bind mount from the host, and on HyperPod the cluster's logs under
/var/log/aws/clusters must be visible."""

from __future__ import annotations

import os
from pathlib import Path

from hpkit.checks.context import Context
from hpkit.checks.mounts import mount_of, read_mounts
from hpkit.checks.probe import read_text
from hpkit.checks.registry import check
from hpkit.checks.result import Result

# Filesystems a container runtime makes for the container itself: /var/log on one of these is not the host's.
_CONTAINER_OWN = frozenset({"overlay", "tmpfs", "aufs", "fuse-overlayfs", "squashfs", "devtmpfs"})

_FIX_BIND = (
    "mount the host's /var/log into the container: `docker run -v /var/log:/var/log …`, "
    "`srun --container-mounts=/var/log:/var/log …` (pyxis), or `enroot start --mount /var/log:/var/log …`"
)


def hyperpod_markers(ctx: Context) -> tuple[Path, Path]:
    # HyperPod nodes carry /opt/sagemaker_cluster (what rendered sbatch scripts test before
    # `srun --auto-resume=1`) and the cluster's resource config, which lifecycle scripts read.
    return ctx.roots.opt / "sagemaker_cluster", ctx.roots.opt / "ml" / "config" / "resource_config.json"


def on_hyperpod(ctx: Context) -> bool:
    return any(m.exists() for m in hyperpod_markers(ctx))


@check("var-log-mount", "/var/log bind-mounted from the host", profiles=("container",))
def var_log_mount(ctx: Context) -> Result:
    mounts = read_mounts(ctx.roots.proc)
    if mounts is None:
        return Result.fail("cannot read /proc/self/mountinfo", "run the check where /proc is mounted")
    target = "/var/log"
    mount = mount_of(target, mounts)
    if mount is None or mount.mount_point.rstrip("/") != target:
        where = f"{mount.fstype} at {mount.mount_point}" if mount else "no mount"
        return Result.fail(
            f"/var/log is the container's own folder (part of the {where}), not the host's", _FIX_BIND
        )
    if mount.fstype in _CONTAINER_OWN and mount.root == "/":
        return Result.fail(f"/var/log is a fresh {mount.fstype} in the container, not the host's", _FIX_BIND)
    shown = f"/var/log is mounted from the host ({mount.source}:{mount.root}, {mount.fstype})"
    if mount.read_only:
        return Result.warn(
            shown + " but read-only: SMDDP cannot write its logs",
            "mount it read-write: `--container-mounts=/var/log:/var/log` (no `:ro`), `-v /var/log:/var/log`",
        )
    return Result.ok(shown)


# Set by hpkit's job scripts on the host (slurm/templates/_container.sbatch.j2): the host root's device:inode.
HOST_ROOT_VAR = "HPKIT_HOST_ROOT"

_FIX_IN_IMAGE = (
    "srun ran this task on the host: with pyxis, make `srun --help` list --container-image on every node "
    "(plugstack.conf loads spank_pyxis.so; on configless Slurm, on every node), then restart slurmd; with Slurm's OCI "
    "containers, put oci.conf beside slurm.conf on every node"
)


def _os_name(etc: Path) -> str:
    for line in (read_text(etc / "os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.partition("=")[2].strip().strip('"')
    return "unknown OS"


@check("in-image", "runs in its container image, not on the host", profiles=("container",))
def in_image(ctx: Context) -> Result:
    """On HyperPod's configless Slurm, srun has been seen to ignore --container-image silently and run the job on the
    host (and Slurm 22.05 ignores --container without oci.conf: measured). The job's batch script, on the host, says
    what the host's root is; a process that sees the same root is not in its image."""
    host = ctx.env.get(HOST_ROOT_VAR, "").strip()
    if not host:
        return Result.skip(
            f"{HOST_ROOT_VAR} is not set: only hpkit's job scripts say what the host's root is",
            "submit the job with `hpkit submit` (container: ...), or export HPKIT_HOST_ROOT=$(stat -Lc %d:%i /) on the host before srun",
        )
    try:
        root = os.stat(ctx.roots.tree)
    except OSError as exc:
        return Result.fail(
            f"cannot stat {ctx.roots.tree}: {exc.strerror}", "run the check where / is readable"
        )
    seen = f"{root.st_dev}:{root.st_ino}"
    name = _os_name(ctx.roots.etc)
    if seen == host:
        return Result.fail(
            f"the root file system is the host's ({seen}, {name}): this is not the container image",
            _FIX_IN_IMAGE,
        )
    return Result.ok(f"in the image ({name}; root {seen}, the host's {host})")


@check("hyperpod-logs", "/var/log/aws/clusters (HyperPod)", profiles=("compute", "container"))
def hyperpod_logs(ctx: Context) -> Result:
    logs = ctx.roots.var_log / "aws" / "clusters"
    if not on_hyperpod(ctx):
        first, second = hyperpod_markers(ctx)
        return Result.skip(
            f"not a HyperPod node (neither {first} nor {second})",
            f"inside a container on HyperPod, mount {first} into it so that this can be checked",
        )
    if not logs.is_dir():
        return Result.fail(f"HyperPod node, but {logs} is missing", _FIX_BIND)
    if not os.access(logs, os.R_OK | os.X_OK):
        return Result.warn(
            f"{logs} exists but this user cannot read it", "run as a user in the log folder's group"
        )
    return Result.ok(f"HyperPod node; {logs} is visible")
