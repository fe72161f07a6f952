"""OCI bundles for Slurm's own containers (container.runtime: oci): check them, and make each job's own.

`hpkit image export --oci DIR` writes an image as a bundle (DIR/rootfs + DIR/config.json, hpkit.image). A
job does not run that bundle as it is: at job start its script writes a bundle of its own (only a config.json,
whose root is the image's rootfs, read-only), with the spec's mounts, the host's /var/log, the working
directory and the image's PATH, so one exported image serves every job. Torch-free: the batch script runs
`python3 -m hpkit.oci bundle ...` on the host, and `hpkit submit` checks the bundle before sbatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hpkit.errors import SpecError

CONFIG = "config.json"
ROOTFS = "rootfs"
OCI_VERSION = "1.0.2"
VAR_LOG = "/var/log"
# Slurm 22.05 merges the image's environment under the step's, so the host's PATH would win inside the
# container: the image's PATH travels under this name and the task puts it back (render.oci_path_step).
IMAGE_PATH_VAR = "HPKIT_IMAGE_PATH"
CPU_SHARES = 1024  # the kernel's weight of one process (cgroup v1 cpu.shares, v2 cpu.weight 100)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# What a container needs besides its image: /proc, the host's devices (GPUs included), /sys read-only and a
# private /tmp (the image's root is read-only). Only a mount namespace: the host's network, as Slurm's OCI
# support requires, and the host's process ids (torchrun and Slurm see the same processes).
BASE_MOUNTS: list[dict[str, Any]] = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind", "nosuid"]},
    {"destination": "/sys", "type": "bind", "source": "/sys", "options": ["rbind", "nosuid", "ro"]},
    {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
]


def runtime_config(
    env: list[str], args: list[str], cwd: str = "/", rootfs: str = ROOTFS, uid: int = 0, gid: int = 0
) -> dict[str, Any]:
    """A runc config.json: the image's process (environment, command, working directory) on its rootfs."""
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": args or ["bash"],
            "env": env,
            "cwd": cwd or "/",
        },
        "root": {"path": rootfs, "readonly": True},
        "mounts": [dict(m) for m in BASE_MOUNTS],
        "linux": {"namespaces": [{"type": "mount"}]},
    }


def bundle_problem(path: str | Path) -> str | None:
    """Why `path` is not an OCI bundle (a rootfs folder and a config.json naming it), or None."""
    bundle = Path(path)
    if not bundle.exists():
        return (
            f"{bundle} does not exist: export the image there with: hpkit image export --oci {bundle} IMAGE"
        )
    if not bundle.is_dir():
        return f"{bundle} is not a directory: an OCI bundle is a directory holding rootfs/ and config.json"
    config_file = bundle / CONFIG
    if not config_file.is_file():
        return f"{bundle} is not an OCI bundle: it has no {CONFIG} (make one with: hpkit image export --oci {bundle} IMAGE)"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        root = config["root"]["path"]
        if not isinstance(root, str) or not isinstance(config.get("process", {}), dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return f"{config_file} is not an OCI runtime config (JSON with root.path and process)"
    rootfs = Path(root) if Path(root).is_absolute() else bundle / root
    if not (rootfs / "bin").exists() and not (rootfs / "usr").is_dir():
        return f"{bundle} is not an OCI bundle: its root file system {rootfs} is missing or empty"
    return None


def check_container(container: Any) -> None:
    """SpecError, one line naming the field, for what the submitting host can tell is wrong (runtime oci)."""
    if container is None or container.runtime != "oci":
        return
    if problem := bundle_problem(container.image):
        raise SpecError(f"container.image: {problem}")
    for mount in container.mounts:
        source = mount.split(":")[0]
        if not os.path.exists(source):
            raise SpecError(f"container.mounts: {mount!r}: its source {source} does not exist on this host")


def _mount(entry: str) -> dict[str, Any]:
    """src:dst[:flags] (the spec's form, as pyxis takes it) as a runc bind mount."""
    parts = entry.split(":")
    options = ["rbind"] + [flag for flag in (parts[2].split("+") if len(parts) > 2 else []) if flag]
    return {"destination": parts[1], "type": "bind", "source": parts[0], "options": options}


def job_config(
    image: Path,
    mounts: list[str],
    var_log: bool,
    workdir: str | None,
    uid: int | None = None,
    gid: int | None = None,
    processes: int = 1,
) -> dict[str, Any]:
    """The config.json of one job's bundle, from the exported image's.

    `processes`: how many busy processes the container holds (a node's ranks and torchrun's agent). runc puts
    the container in a cgroup of its own, which the kernel weighs as one process against the node's others
    (cpu.shares 1024): its CPU weight is set to what its processes would weigh outside it.
    """
    config = json.loads((image / CONFIG).read_text(encoding="utf-8"))
    config["root"] = {"path": str(image_root(image)), "readonly": True}
    process = config.setdefault("process", {})
    process["terminal"] = False
    process["user"] = {
        "uid": os.getuid() if uid is None else uid,
        "gid": os.getgid() if gid is None else gid,
    }
    if workdir:
        process["cwd"] = workdir
    env = [e for e in process.get("env", []) if not e.startswith(f"{IMAGE_PATH_VAR}=")]
    image_path = next((e.split("=", 1)[1] for e in env if e.startswith("PATH=")), DEFAULT_PATH)
    process["env"] = [*env, f"{IMAGE_PATH_VAR}={image_path}"]
    wanted = [_mount(m) for m in mounts]
    if var_log and not any(m["destination"] == VAR_LOG for m in wanted):
        # rbind: /var/log/aws/clusters (HyperPod) and any other mount below /var/log come along.
        wanted.insert(
            0, {"destination": VAR_LOG, "type": "bind", "source": VAR_LOG, "options": ["rbind", "rw"]}
        )
    image_etc = image_root(image)
    for name in HOST_FILES:
        if os.path.isfile(name) and (image_etc / name.lstrip("/")).is_file():
            wanted.insert(0, {"destination": name, "type": "bind", "source": name, "options": ["bind", "ro"]})
    config.setdefault("linux", {}).setdefault("resources", {})["cpu"] = {
        "shares": CPU_SHARES * max(1, processes)
    }
    taken = {m["destination"] for m in wanted}
    config["mounts"] = [m for m in config.get("mounts", []) if m.get("destination") not in taken] + wanted
    return config


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Through a temporary file and a rename: a reader (slurmstepd) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


# The node's own name service files, as Docker, podman and enroot give their containers: torchrun's
# rendezvous publishes the host's name, which the image's /etc/hosts does not know.
HOST_FILES = ("/etc/hosts", "/etc/resolv.conf", "/etc/hostname")

# Made by the runtime, not taken from the image: BASE_MOUNTS.
_RUNTIME_DIRS = frozenset(m["destination"].lstrip("/") for m in BASE_MOUNTS)


def image_root(image: Path) -> Path:
    config = json.loads((image / CONFIG).read_text(encoding="utf-8"))
    root = Path(config.get("root", {}).get("path", ROOTFS))
    return root if root.is_absolute() else (image / root).resolve()


def write_job_bundle(
    out: Path, image: Path, mounts: list[str], var_log: bool, workdir: str | None, processes: int = 1
) -> dict[str, Any]:
    """The job's bundle: its config.json, and a root whose top-level folders are the image's, bound read-only.

    Slurm 22.05 runs <bundle>/rootfs whatever root.path says, and runc takes no symlink there: the job's
    rootfs holds only mount points (and the image's top-level links, bin -> usr/bin), so one exported image
    serves every job at no copying cost, and the spec's mount points can be made in it.
    """
    config = job_config(image, mounts, var_log, workdir, processes=processes)
    source = Path(config["root"]["path"])
    root = out / ROOTFS
    root.mkdir(parents=True, exist_ok=True)
    binds = []
    for entry in sorted(source.iterdir(), key=lambda p: p.name):
        target = root / entry.name
        if entry.is_symlink():
            if not target.is_symlink():
                target.symlink_to(os.readlink(entry))
        elif entry.is_dir():
            target.mkdir(exist_ok=True)
            if entry.name not in _RUNTIME_DIRS:
                binds.append(
                    {
                        "destination": f"/{entry.name}",
                        "type": "bind",
                        "source": str(entry),
                        "options": ["rbind", "ro"],
                    }
                )
        else:
            target.touch(exist_ok=True)
            binds.append(
                {
                    "destination": f"/{entry.name}",
                    "type": "bind",
                    "source": str(entry),
                    "options": ["bind", "ro"],
                }
            )
    config["root"] = {"path": ROOTFS, "readonly": True}
    config["mounts"] = binds + config["mounts"]
    write_json(out / CONFIG, config)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m hpkit.oci bundle", description="write a job's OCI bundle from an exported image"
    )
    parser.add_argument("action", choices=["bundle"])
    parser.add_argument("--image", required=True, help="the exported image's bundle directory")
    parser.add_argument("--out", required=True, help="the job's bundle directory (its config.json)")
    parser.add_argument("--mount", action="append", default=[], help="src:dst[:flags], as in the spec")
    parser.add_argument("--var-log", action="store_true", help="bind the host's /var/log")
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--processes", type=int, default=1, help="busy processes per container (its CPU weight)"
    )
    args = parser.parse_args(argv)
    image = Path(args.image)
    if problem := bundle_problem(image):
        print(f"hpkit: container.image: {problem}", file=sys.stderr)
        return 1
    missing = [m for m in args.mount if not os.path.exists(m.split(":")[0])]
    if missing:
        print(
            f"hpkit: container.mounts: {missing[0]!r}: its source does not exist on this node",
            file=sys.stderr,
        )
        return 1
    write_job_bundle(Path(args.out), image, args.mount, args.var_log, args.workdir, args.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
