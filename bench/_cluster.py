"""A private local Slurm cluster for a benchmark: its own directory, port and job ids, stopped at the end."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benchmarks measure this checkout's hpkit, whichever one the venv has installed.
sys.path.insert(0, str(REPO / "python"))

from hpkit import devcluster  # noqa: E402

ClusterError = devcluster.DevClusterError


@contextlib.contextmanager
def private_cluster(prefix: str, port: str, first_job_id: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """Start slurm/dev's 2-node x 2-CPU cluster in a fresh scratch directory; yields (that directory,
    the environment for the cluster's clients). Both go away at the end."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        env = devcluster.client_env(work / "cluster", port, first_job_id)
        # Scratch files and the Python that runs the benchmark, for the jobs as well.
        env.update(TMPDIR=str(work), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
        with devcluster.running(env):
            yield work, env
    finally:
        shutil.rmtree(work, ignore_errors=True)
