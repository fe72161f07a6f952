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

from _clusters import slot  # noqa: E402  (tests/_clusters.py: every cluster's ports and job ids)


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
    # Not a developer's `make cluster-up` cluster, nor another xdist worker's: its own directory,
    # ports and job ids.
    env = devcluster.client_env(tmp_path_factory.mktemp("slurm-cluster"), *slot("session"))
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


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test is a failed one: CI installs everything the suite needs (`make test`),
    so a skip there means a check silently did not run (a missing cgroup controller, package or tool)."""
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every check must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (pytest.importorskip at the top of a file)."""
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every check must run: {reason}"


# The files that take minutes (measured: `make test` prints the slowest), handed out first, so that
# pytest-xdist's workers do not end on one long file while the others idle.
SLOW_FILES_FIRST = (
    "test_image_build.py",
    "test_oci_jobs.py",
    "test_node_loss.py",
    "test_why_jobs.py",
    "test_slurm_polling.py",
    "test_training_resume.py",
    "test_resilience.py",
    "test_install_paths.py",
    "test_stragglers.py",
    "test_check_all_nodes.py",
    "test_checkpoint_crash.py",
    "test_smp_jobs.py",
    "test_training_correctness.py",
    "test_moe.py",
    "test_smp_v2.py",
    "test_hang_recovery.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order otherwise kept
