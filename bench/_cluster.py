"""A private local Slurm cluster for a benchmark: its own directory, port and job ids, stopped at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class ClusterError(RuntimeError):
    pass


@contextlib.contextmanager
def private_cluster(prefix: str, port: str, first_job_id: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """Start slurm/dev's 2-node x 2-CPU cluster in a fresh scratch directory; yields (that directory,
    the environment for the cluster's clients). Both go away at the end."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with _running(work, port, first_job_id) as env:
            yield work, env
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _running(work: Path, port: str, first_job_id: str) -> Iterator[dict[str, str]]:
    cluster = work / "cluster"
    env = dict(os.environ)
    env.update(
        HPKIT_DEV_CLUSTER_DIR=str(cluster),
        HPKIT_DEV_PORT=port,
        FIRST_JOB_ID=first_job_id,
        NODES="2",
        CPUS="2",
        SLURM_CONF=str(cluster / "etc" / "slurm.conf"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p),
        TMPDIR=str(work),
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
    )
    up = subprocess.run([str(REPO / "slurm/dev/up.sh")], env=env, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        raise ClusterError(f"the local cluster did not come up: {up.stderr.strip()}")
    try:
        yield env
    finally:
        subprocess.run([str(REPO / "slurm/dev/down.sh")], env=env, capture_output=True, timeout=120)
