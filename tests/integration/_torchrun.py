"""Starting real multi-process torch runs from tests: torchrun with a private TMPDIR and one thread each."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpkit.rendezvous import free_local_ports

REPO = Path(__file__).resolve().parents[2]


def torch_env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    python_path = [str(REPO / "python"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in python_path if p),
        # torchrun leaves a torchelastic_* folder per run in TMPDIR; keep each test's to itself.
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPKIT_SPEC"):
        env.pop(var, None)
    return env


def run(
    args: list[str],
    tmp: Path,
    nproc: int | None,
    timeout: float = 400,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python ARGS` (nproc None) or `torchrun --nproc-per-node N ARGS`, with `extra_env` added to its
    environment; fail with its output."""
    if nproc is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            # A free port per launch, so concurrent test runs on this host do not collide.
            "--standalone",
            *args,
        ]
    env = torch_env(tmp) | (extra_env or {})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited with {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n"
            f"--- stderr\n{done.stderr[-10000:]}"
        )
    return done


def run_together(launches: dict[Any, tuple], timeout: float = 400) -> dict[Any, subprocess.CompletedProcess]:
    """`run` for each named (args, tmp, nproc[, extra_env]) at once: independent launches of one fixture
    overlap their interpreter and torch start-up, rendezvous and shutdown instead of waiting on each other.
    Each needs its own tmp; a failure is raised once every launch has ended."""
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {k: pool.submit(run, *launch[:3], timeout, *launch[3:]) for k, launch in launches.items()}
        return {k: f.result() for k, f in futures.items()}


def run_two_agents(
    args: list[str], tmp: Path, nproc: int, second_node_hides: Path, timeout: float = 400
) -> subprocess.CompletedProcess:
    """Two torchrun agents on this host, as two nodes of `nproc` ranks each; the second runs in its own
    mount namespace where `second_node_hides` reads as an empty file (root only: unshare -m)."""
    port = free_local_ports()

    def agent(node_rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=hpkit-test-{port}",
            *args,
        ]

    hide = f'mount --bind /dev/null {shlex.quote(str(second_node_hides))} && exec "$@"'
    second = ["unshare", "-m", "--propagation", "private", "sh", "-c", hide, "sh", *agent(1)]
    env = torch_env(tmp)
    first_proc = subprocess.Popen(
        agent(0), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    second_proc = subprocess.Popen(
        second, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        out1, err1 = first_proc.communicate(timeout=timeout)
        out2, err2 = second_proc.communicate(timeout=timeout)
    finally:
        for p in (first_proc, second_proc):
            if p.poll() is None:
                p.kill()
    if first_proc.returncode or second_proc.returncode:
        raise AssertionError(
            f"two-agent run exited with {first_proc.returncode}/{second_proc.returncode}\n--- node 1 stdout\n"
            f"{out1[-4000:]}\n--- node 1 stderr\n{err1[-6000:]}\n--- node 2 stderr\n{err2[-6000:]}"
        )
    return subprocess.CompletedProcess(agent(0), 0, out1 + out2, err1 + err2)
