"""The cluster around the node: Slurm answers, pyxis gives srun --container-image, enroot has room to work."""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hpkit.checks.context import Context
from hpkit.checks.probe import CmdResult, read_text, run_cmd, slurm_result, which
from hpkit.checks.registry import check
from hpkit.checks.result import Result
from hpkit.slurm import client, topology
from hpkit.slurm.hostlist import compress

PROFILES = ("login", "compute")
# Container images unpack to tens of GiB; enroot's data and cache folders need at least this much room.
ENROOT_MIN_FREE_GIB = 50
# The runtime folder holds only per-container state (HyperPod still moves it to NVMe).
ENROOT_RUNTIME_MIN_FREE_GIB = 1


def _slurm_dirs(ctx: Context) -> list[Path]:
    # HyperPod installs Slurm under /opt/slurm; Debian and most others under /usr/bin.
    return [ctx.roots.opt / "slurm" / "bin"]


def _ask(ctx: Context, command: Callable[..., client.Answer]) -> CmdResult:
    """One of the Slurm client's calls, with this node's environment, Slurm folders and probe timeout."""
    return slurm_result(command(ctx.env, ctx.probe_timeout, _slurm_dirs(ctx)), ctx.probe_timeout)


_FIX_SLURM_CLIENT = (
    "install the Slurm client or put it on PATH (HyperPod: `export PATH=/opt/slurm/bin:$PATH`), "
    "then run the check again"
)


@check("slurm", "Slurm controller answers (sinfo)", profiles=PROFILES)
def slurm(ctx: Context) -> Result:
    if not client.installed(ctx.env, _slurm_dirs(ctx), client.SINFO):
        return Result.fail("sinfo is not installed or not on PATH", _FIX_SLURM_CLIENT)
    ran = _ask(ctx, client.partitions)
    if not ran.ok:
        return Result.fail(
            f"sinfo cannot reach the controller: {ran.why()}",
            "set SLURM_CONF to the cluster's slurm.conf (HyperPod: /opt/slurm/etc/slurm.conf), check that "
            "munged runs (`systemctl status munge`) and slurmctld answers (`scontrol ping`)",
        )
    partitions: set[str] = set()
    states: Counter[str] = Counter()
    for line in ran.out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        partitions.add(parts[0].rstrip("*"))
        states[parts[2].rstrip("*~#!%$@^-")] += int(parts[1])
    if not states:
        return Result.warn("sinfo answers but lists no nodes", "add nodes to a partition in slurm.conf")
    shown = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    usable = sum(
        n for state, n in states.items() if state in ("idle", "mix", "alloc", "comp", "resv", "plnd")
    )
    detail = f"{len(partitions)} partition(s) ({', '.join(sorted(partitions))}); nodes: {shown}"
    if usable == 0:
        return Result.warn(
            detail + "; none can run jobs",
            "see why with `sinfo -R`; resume a node with `scontrol update nodename=NAME state=resume`",
        )
    return Result.ok(detail)


def _slurm_conf(ctx: Context) -> Path | None:
    """The slurm.conf this node's clients read: SLURM_CONF, else where HyperPod and Debian put it."""
    candidates = [Path(ctx.env["SLURM_CONF"])] if ctx.env.get("SLURM_CONF") else []
    candidates += [ctx.roots.opt / "slurm" / "etc" / "slurm.conf", ctx.roots.etc / "slurm" / "slurm.conf"]
    return next((path for path in candidates if path.is_file()), None)


def _topology_file_problem(ctx: Context, why: str) -> Result:
    """The controller cannot be asked: say what this node's slurm.conf and topology.conf would do to it."""
    conf = _slurm_conf(ctx)
    text = read_text(conf) if conf else None
    plugin = topology.conf_value(text or "", "TopologyPlugin") or ""
    if conf is None or plugin in topology.FLAT_PLUGINS:
        return Result.skip(f"`scontrol show config` failed ({why})", "see the slurm check")
    topo = conf.parent / "topology.conf"
    if not topo.is_file():
        return Result.fail(
            f"the controller does not answer ({why}); {conf} sets TopologyPlugin={plugin} and {topo} is missing: "
            "slurmctld stops at start without it (Slurm 24.11: 'fatal: something wrong with opening/reading "
            "topology.conf')",
            f"write {topo} naming every node (`python3 -m hpkit.slurm.topology render --plugin {plugin} --nodes "
            "NODELIST`), or drop TopologyPlugin; then restart slurmctld",
        )
    return Result.skip(f"`scontrol show config` failed ({why}); {topo} exists", "see the slurm check")


@check("topology", "Slurm topology: what TopologyPlugin needs", profiles=("login",))
def slurm_topology(ctx: Context) -> Result:
    if not client.installed(ctx.env, _slurm_dirs(ctx), client.SCONTROL, client.SINFO):
        return Result.skip("scontrol or sinfo is not on PATH", _FIX_SLURM_CLIENT)
    shown = _ask(ctx, client.show_config)
    if not shown.ok:
        return _topology_file_problem(ctx, shown.why())
    plugin = topology.config_value(shown.out, "TopologyPlugin") or ""
    if plugin in topology.FLAT_PLUGINS:
        return Result.ok(f"TopologyPlugin={plugin or '(unset)'}: no topology.conf needed")
    if plugin not in (topology.TREE, topology.BLOCK):
        return Result.skip(f"TopologyPlugin={plugin}: hpkit checks topology/tree and topology/block only")
    fix_file = (
        "name every node in the cluster's topology.conf "
        f"(`python3 -m hpkit.slurm.topology render --plugin {plugin} --nodes NODELIST` writes one), then "
        "`scontrol reconfigure`"
    )
    asked = _ask(ctx, client.show_topology)
    groups = topology.parse(asked.out) if asked.ok else []
    if not groups:
        why = asked.why() if not asked.ok else "it lists no switch or block"
        return Result.fail(
            f"TopologyPlugin={plugin} but `scontrol show topology` answers nothing ({why})", fix_file
        )
    listed = _ask(ctx, client.node_names)
    if not listed.ok:
        return Result.skip(f"sinfo failed ({listed.why()})", "see the slurm check")
    nodes = {line.strip() for line in listed.out.splitlines() if line.strip()}
    missing = nodes - topology.placed_nodes(groups)
    kind = "switch" if plugin == topology.TREE else "block"
    if missing:
        return Result.fail(
            f"TopologyPlugin={plugin}: {len(missing)} of {len(nodes)} nodes are in no {kind} "
            f"({compress(missing)}): sbatch refuses jobs that need them "
            "('Requested topology configuration is not available')",
            fix_file,
        )
    if plugin == topology.TREE and not topology.switch_reaching_all(groups):
        # Measured on 22.05 and 24.11: sbatch then refuses any job larger than one part of the tree.
        return Result.fail(
            f"TopologyPlugin={plugin}: no switch reaches all {len(nodes)} nodes: sbatch refuses a job that "
            "spans two parts of the tree",
            "add a top switch over the others in topology.conf (SwitchName=spine Switches=...), then "
            "`scontrol reconfigure`",
        )
    count = sum(1 for g in groups if g.kind == kind)
    noun = "switches" if kind == "switch" else "blocks"
    return Result.ok(f"TopologyPlugin={plugin}: {count} {noun} place all {len(nodes)} nodes")


def _plugstack_mentions_pyxis(ctx: Context) -> Path | None:
    """The plugstack file that loads pyxis's SPANK plugin, following its `include` lines one level."""
    candidates = []
    if ctx.env.get("SLURM_CONF"):
        candidates.append(Path(ctx.env["SLURM_CONF"]).parent / "plugstack.conf")
    candidates += [
        ctx.roots.etc / "slurm" / "plugstack.conf",
        ctx.roots.opt / "slurm" / "etc" / "plugstack.conf",
    ]
    for conf in candidates:
        text = read_text(conf)
        if text is None:
            continue
        files = [(conf, text)]
        for pattern in re.findall(r"^\s*include\s+(\S+)", text, re.MULTILINE):
            pattern_path = Path(pattern) if pattern.startswith("/") else conf.parent / pattern
            for included in sorted(pattern_path.parent.glob(pattern_path.name)):
                files.append((included, read_text(included) or ""))
        for path, body in files:
            live = [line for line in body.splitlines() if not line.lstrip().startswith("#")]
            if any("pyxis" in line for line in live):
                return path
    return None


_FIX_PYXIS = (
    "install pyxis on every node (HyperPod: the `install_pyxis` step of the lifecycle scripts; otherwise "
    "https://github.com/NVIDIA/pyxis) so plugstack.conf loads spank_pyxis.so, then restart slurmd"
)


@check("pyxis", "pyxis (srun --container-image)", profiles=PROFILES)
def pyxis(ctx: Context) -> Result:
    srun = which("srun", ctx.env, _slurm_dirs(ctx))
    if srun is None:
        return Result.fail("srun is not installed or not on PATH", _FIX_SLURM_CLIENT)
    ran = run_cmd([srun, "--help"], ctx.probe_timeout, ctx.env)
    if ran.ok:
        if "--container-image" in ran.out:
            return Result.ok("`srun --help` lists --container-image")
        return Result.fail("`srun --help` has no --container-image: pyxis is not loaded", _FIX_PYXIS)
    # srun loads SPANK plugins only once it has the cluster's configuration; say what the files say.
    conf = _plugstack_mentions_pyxis(ctx)
    if conf is not None:
        return Result.warn(
            f"`srun --help` failed ({ran.why()}); {conf} loads pyxis",
            "make the Slurm client work first (see the slurm check); then run the check again",
        )
    return Result.fail(f"`srun --help` failed ({ran.why()}) and no plugstack.conf loads pyxis", _FIX_PYXIS)


# `hpkit check` runs one task in this image when set: a pyxis image (registry reference or .sqsh), or oci:BUNDLE.
CHECK_IMAGE_VAR = "HPKIT_CHECK_IMAGE"
# Seconds for each of its two sruns: enroot may have to pull and unpack the image first.
CHECK_IMAGE_TIMEOUT_S = 300.0
_ROOT_ID = 'echo "$(stat -Lc %d:%i /) ${SLURMD_NODENAME:-$(hostname)}"'


@check("container-runs", "a job really runs in its container image", profiles=("login",))
def container_runs(ctx: Context) -> Result:
    """On HyperPod's configless Slurm, srun has been seen to take --container-image and run the task on the host,
    saying nothing (and Slurm 22.05 does so with --container when a node has no oci.conf: measured). One task on
    the host and one in the image, on the same node, compare the root they see."""
    image = ctx.env.get(CHECK_IMAGE_VAR, "").strip()
    if not image:
        return Result.skip(
            f"{CHECK_IMAGE_VAR} is not set",
            f"set {CHECK_IMAGE_VAR}=IMAGE (pyxis: a registry reference or .sqsh; Slurm's OCI: oci:/path/to/bundle) "
            "to run one task in it and check that srun does not ignore the container",
        )
    srun = which("srun", ctx.env, _slurm_dirs(ctx))
    if srun is None:
        return Result.fail("srun is not installed or not on PATH", _FIX_SLURM_CLIENT)
    timeout = max(ctx.probe_timeout, CHECK_IMAGE_TIMEOUT_S)
    base = [srun, "--nodes=1", "--ntasks=1", "--time=5", "--job-name=hpkit-check-container"]
    host = run_cmd([*base, "sh", "-c", _ROOT_ID], timeout, ctx.env)
    if not host.ok or len(host.out.split()) != 2:
        return Result.fail(
            f"a plain one-task job failed: {host.why()}", "see the slurm check; `srun hostname` must work"
        )
    host_root, node = host.out.split()
    if image.startswith("oci:"):
        flags = [f"--container={image[4:]}"]
        fix = f"put oci.conf beside slurm.conf on {node} (every node), then restart slurmd"
    else:
        flags = [f"--container-image={image}"]
        fix = (
            f"load pyxis on {node} (every node): plugstack.conf includes spank_pyxis.so (on configless Slurm, "
            "the controller's plugstack.conf too), then restart slurmd; the pyxis check says more"
        )
    inside = run_cmd([*base, f"--nodelist={node}", *flags, "sh", "-c", _ROOT_ID], timeout, ctx.env)
    if not inside.ok or len(inside.out.split()) != 2:
        return Result.fail(
            f"a one-task job in {image} failed on {node}: {inside.why()}",
            f"run it by hand to see why: srun --nodelist={node} {flags[0]} true",
        )
    seen = inside.out.split()[0]
    if seen == host_root:
        return Result.fail(
            f"srun ran the task for {image} on {node}'s host, not in the image (the same root, {seen}), saying nothing",
            fix,
        )
    return Result.ok(
        f"a task in {image} on {node} sees the image's root ({seen}), not the host's ({host_root})"
    )


def _enroot_paths(ctx: Context) -> dict[str, str]:
    """ENROOT_DATA_PATH, _CACHE_PATH and _RUNTIME_PATH as enroot resolves them: environment, then enroot.conf,
    then its defaults."""
    home = ctx.env.get("HOME", str(Path.home()))
    uid = str(os.getuid())
    values = {
        "ENROOT_RUNTIME_PATH": ctx.env.get("XDG_RUNTIME_DIR", f"/run/user/{uid}") + "/enroot",
        "ENROOT_CACHE_PATH": ctx.env.get("XDG_CACHE_HOME", f"{home}/.cache") + "/enroot",
        "ENROOT_DATA_PATH": ctx.env.get("XDG_DATA_HOME", f"{home}/.local/share") + "/enroot",
    }
    conf = Path(ctx.env.get("ENROOT_CONFIG_PATH", str(ctx.roots.etc / "enroot"))) / "enroot.conf"
    for line in (read_text(conf) or "").splitlines():
        parts = line.split("#", 1)[0].split(None, 1)
        if len(parts) == 2 and parts[0] in values:
            values[parts[0]] = parts[1].strip()
    for key in values:
        if ctx.env.get(key):
            values[key] = ctx.env[key]
    env = {**ctx.env, "HOME": home}
    for key, raw in values.items():
        # enroot.conf is read by a shell: expand what is cheap to expand, and keep the fixed prefix of the rest.
        text = raw.replace("$(id -u)", uid).replace("${UID}", uid).replace("$UID", uid)
        text = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)
        values[key] = text.split("$", 1)[0] if "$" in text else text
    return values


def _free_gib(path: str) -> tuple[str, float] | None:
    """Free space at path, measured at its nearest existing ancestor (enroot creates its folders on use)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return str(probe), shutil.disk_usage(probe).free / 2**30
    except OSError:
        return None


@check("enroot", "enroot installed, its folders on a large disk", profiles=PROFILES)
def enroot(ctx: Context) -> Result:
    binary = which("enroot", ctx.env)
    if binary is None:
        return Result.fail(
            "enroot is not installed or not on PATH",
            "install enroot (https://github.com/NVIDIA/enroot; HyperPod: the lifecycle scripts' "
            "`install_enroot_pyxis` step)",
        )
    ran = run_cmd([binary, "version"], ctx.probe_timeout, ctx.env)
    if not ran.ok:
        return Result.fail(
            f"`enroot version` failed: {ran.why()}", "reinstall enroot; check /etc/enroot/enroot.conf"
        )
    small = []
    shown = []
    for key, path in _enroot_paths(ctx).items():
        free = _free_gib(path)
        label = key.replace("ENROOT_", "").replace("_PATH", "").lower()
        if free is None:
            small.append(f"{label} {path} (unreadable)")
            continue
        shown.append(f"{label} {path} ({free[1]:.0f} GiB free)")
        wanted = ENROOT_RUNTIME_MIN_FREE_GIB if label == "runtime" else ENROOT_MIN_FREE_GIB
        if free[1] < wanted:
            small.append(f"{label} {path} has {free[1]:.0f} GiB free")
    version = ran.out.strip() or "?"
    if small:
        return Result.warn(
            f"enroot {version}; " + "; ".join(small),
            f"point ENROOT_DATA_PATH and ENROOT_CACHE_PATH (in /etc/enroot/enroot.conf) at a large local disk "
            f"with ≥ {ENROOT_MIN_FREE_GIB} GiB free, e.g. /opt/dlami/nvme on HyperPod, or /fsx for the cache",
        )
    return Result.ok(f"enroot {version}; " + "; ".join(shown))
