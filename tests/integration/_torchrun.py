"""Starting real multi-process torch runs from tests: torchrun with a private TMPDIR and one thread each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def run(args: list[str], tmp: Path, nproc: int | None, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run `python ARGS` (nproc None) or `torchrun --nproc-per-node N ARGS`; fail with its output."""
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
    done = subprocess.run(cmd, env=torch_env(tmp), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited with {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n"
            f"--- stderr\n{done.stderr[-10000:]}"
        )
    return done
