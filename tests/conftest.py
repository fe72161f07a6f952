"""Shared fixtures: the repository root, and a real local Slurm cluster for integration tests."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from hpkit import devcluster  # noqa: E402  (from this checkout, put on the path just above)

# tests/gpu is the CUDA half of the suite: `make test-gpu` (HPKIT_GPU_TESTS=1) on a GPU machine. CI has no GPU.
collect_ignore = [] if os.environ.get("HPKIT_GPU_TESTS") == "1" else ["gpu"]

# The test cluster must not collide with a developer's `make cluster-up` cluster: its own
# directory, ports, and job ids (job scripts derive their rendezvous port from the job id).
# Two test runs on one host (two checkouts) each set their own pair.
TEST_CLUSTER_PORT = os.environ.get("HPKIT_TEST_CLUSTER_PORT", "7817")
TEST_FIRST_JOB_ID = os.environ.get("HPKIT_TEST_FIRST_JOB_ID", "5000")


@pytest.fixture(scope="session", autouse=True)
def job_notes(tmp_path_factory) -> Path:
    """`hpkit submit` notes each job under HPKIT_STATE_DIR: the tests' notes stay out of the home directory."""
    state = tmp_path_factory.mktemp("hpkit-state")
    os.environ["HPKIT_STATE_DIR"] = str(state)
    return state


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> dict[str, str]:
    """Start a 2-node x 2-CPU cluster for this test session; returns the environment for clients."""
    if shutil.which("slurmctld") is None:
        pytest.fail("slurmctld not found: `make test` installs slurm-wlm; run it, or `make system-deps`")
    env = devcluster.client_env(
        tmp_path_factory.mktemp("slurm-cluster"), TEST_CLUSTER_PORT, TEST_FIRST_JOB_ID
    )
    try:
        devcluster.up(env)
    except devcluster.DevClusterError as exc:
        pytest.fail(str(exc))
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PYTHONPATH")}
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    yield env
    devcluster.down(env)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
