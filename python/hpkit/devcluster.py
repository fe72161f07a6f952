"""A private local Slurm cluster from slurm/dev (tests, benchmarks): its clients' environment, start, stop.

A private cluster has its own state directory, controller port and first job id, so that it does not
collide with a developer's `make cluster-up` cluster or another checkout's: job scripts derive their
rendezvous port from the job id. Torch-free; works from a source checkout only (slurm/dev is not shipped).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from hpkit.errors import HpkitError

# This module's package lives in <repo>/python/hpkit.
PYTHON_DIR = Path(__file__).resolve().parents[1]
DEV_DIR = PYTHON_DIR.parent / "slurm" / "dev"
SCRIPT_TIMEOUT_S = 120
# The Slurm versions slurm/dev/up.sh runs: the host's Debian 12 packages, and HyperPod's from a trixie root.
SLURM_VERSIONS = ("22.05", "24.11")
# slurm/dev/up.sh's NET: every node on 127.0.0.1, or each in a network namespace of its own (slurm/dev/net.sh).
NET_LAYOUTS = ("loopback", "netns")


class DevClusterError(HpkitError):
    """The private cluster could not be started."""


def client_env(
    state_dir: Path,
    port: str | int,
    first_job_id: str | int,
    nodes: int = 2,
    cpus: int = 2,
    base: Mapping[str, str] | None = None,
    slurmd_timeout: int | None = None,
    min_job_age: int | None = None,
    bf_interval: int | None = None,
    memory_kill: bool = False,
    slurm: str = "22.05",
    net: str = "loopback",
    accounting: bool = False,
) -> dict[str, str]:
    """The environment for slurm/dev's scripts and the cluster's clients (sbatch, squeue, its jobs).

    `base` (default: this process's environment) is copied, not changed. `slurmd_timeout`: seconds
    before a silent node is declared DOWN; `min_job_age`: seconds the controller keeps an ended job;
    `bf_interval`: seconds between backfill passes, the one that starts a requeued job (slurm/dev's defaults
    where None); `memory_kill`: schedule memory and kill a step over its job's --mem
    (slurm/dev/up.sh's MEMORY_KILL); `slurm`: "22.05" (the host's packages) or "24.11" (from a Debian
    trixie root, through the wrappers that up.sh writes in `<state_dir>/bin`, first on this PATH); `net`:
    "loopback" (every NodeAddr 127.0.0.1) or "netns" (a network namespace and an address per node);
    `accounting`: the cluster's own slurmdbd, its records in the machine's MariaDB (up.sh's ACCOUNTING=1), so
    that sacct answers for jobs the controller has forgotten.
    """
    if slurm not in SLURM_VERSIONS:
        raise DevClusterError(f"slurm must be one of {', '.join(SLURM_VERSIONS)}, not {slurm!r}")
    if net not in NET_LAYOUTS:
        raise DevClusterError(f"net must be one of {', '.join(NET_LAYOUTS)}, not {net!r}")
    env = dict(os.environ if base is None else base)
    env.update(
        HPKIT_DEV_CLUSTER_DIR=str(state_dir),
        HPKIT_DEV_PORT=str(port),
        FIRST_JOB_ID=str(first_job_id),
        NODES=str(nodes),
        CPUS=str(cpus),
        SLURM=slurm,
        NET=net,
        SLURM_CONF=str(Path(state_dir) / "etc" / "slurm.conf"),
        # Jobs import hpkit from this checkout whichever Python runs them.
        PYTHONPATH=os.pathsep.join(p for p in (str(PYTHON_DIR), env.get("PYTHONPATH")) if p),
    )
    if slurm != "22.05":
        env["PATH"] = os.pathsep.join(p for p in (str(Path(state_dir) / "bin"), env.get("PATH")) if p)
    if slurmd_timeout is not None:
        env["SLURMD_TIMEOUT"] = str(slurmd_timeout)
    if min_job_age is not None:
        env["MIN_JOB_AGE"] = str(min_job_age)
    if bf_interval is not None:
        env["BF_INTERVAL"] = str(bf_interval)
    if memory_kill:
        env["MEMORY_KILL"] = "1"
    # Always set: an ACCOUNTING=1 in the caller's environment must not give every test cluster a slurmdbd.
    env["ACCOUNTING"] = "1" if accounting else "0"
    return env


def _script(name: str) -> str:
    path = DEV_DIR / name
    if not path.is_file():
        raise DevClusterError(f"{path} not found: the dev cluster runs from a source checkout of hpkit")
    return str(path)


def up(env: Mapping[str, str]) -> None:
    """Start the cluster that `env` (from `client_env`) describes; a running one is left as it is."""
    done = subprocess.run(
        [_script("up.sh")], env=dict(env), capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S
    )
    if done.returncode != 0:
        output = "\n".join(s.strip() for s in (done.stdout, done.stderr) if s.strip())
        raise DevClusterError(f"the local cluster did not come up: {output or f'exit {done.returncode}'}")


def down(env: Mapping[str, str]) -> None:
    """Stop the daemons that `up` started for `env`. Best effort: it runs on the way out of errors too, in a
    session of its own, so that a second Ctrl-C at the terminal does not stop it half way."""
    subprocess.run(
        [_script("down.sh")],
        env=dict(env),
        capture_output=True,
        timeout=SCRIPT_TIMEOUT_S,
        start_new_session=True,
    )


@contextlib.contextmanager
def running(env: Mapping[str, str]) -> Iterator[Mapping[str, str]]:
    """The cluster up for the body of a `with`, and down afterwards whatever happened: an error, Ctrl-C, or a
    SIGTERM (a `timeout` wrapper's, a CI runner's), which would otherwise end Python without its `finally` and
    leave the daemons running. Also a cluster that failed half way up goes down."""
    with _terminate_as_exit():
        try:
            up(env)
            yield env
        finally:
            down(env)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread for the body, where nothing else handles it."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def exit_on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# The fault helpers of a NET=netns cluster (slurm/dev/net.sh), for tests and drills. `node` is a node name
# (node1, node2, ...); each raises DevClusterError with the script's message when it fails.


def _net(env: Mapping[str, str], *args: str) -> str:
    done = subprocess.run(
        [_script("net.sh"), env["HPKIT_DEV_CLUSTER_DIR"], *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    if done.returncode != 0:
        message = done.stderr.strip() or f"exit {done.returncode}"
        raise DevClusterError(f"net.sh {' '.join(args)}: {message}")
    return done.stdout.strip()


def node_address(env: Mapping[str, str], node: str) -> str:
    """The node's own address (its NodeAddr)."""
    return _net(env, "addr", node)


def node_command(env: Mapping[str, str], node: str, argv: list[str]) -> list[str]:
    """`argv` as a command line that runs inside the node's network namespace."""
    return [_script("net.sh"), env["HPKIT_DEV_CLUSTER_DIR"], "exec", node, *argv]


def cut(env: Mapping[str, str], node: str) -> None:
    """Take the node's link down: the node reaches no one and no one reaches it (its processes keep running)."""
    _net(env, "cut", node)


def restore(env: Mapping[str, str], node: str) -> None:
    """Bring a cut link back up."""
    _net(env, "restore", node)


def slow(
    env: Mapping[str, str],
    node: str,
    delay: str | None = None,
    rate: str | None = None,
    loss: str | None = None,
) -> None:
    """Shape the node's link in both directions (tc's units: delay '50ms', rate '10mbit', loss '1%').

    tc netem where the kernel has it (`netem_available`); else tbf for the rate and slurm/dev/netdelay.py (user
    space, behind iptables NFQUEUE rules in the node's namespace) for delay and loss."""
    options = [
        word
        for flag, value in (("--delay", delay), ("--rate", rate), ("--loss", loss))
        if value
        for word in (flag, value)
    ]
    _net(env, "slow", node, *options)


def unslow(env: Mapping[str, str], node: str) -> None:
    """Remove the shaping that `slow` added."""
    _net(env, "unslow", node)


def second_interface(env: Mapping[str, str], node: str) -> None:
    """Give the node a second interface (ib0, unroutable address) listed before its real one (eth0)."""
    _net(env, "second-if", node)


def netem_available() -> bool:
    """Whether this kernel has tc netem (delay, loss), probed in a throwaway namespace."""
    return subprocess.run([_script("net.sh"), "has-netem"], capture_output=True, timeout=30).returncode == 0
