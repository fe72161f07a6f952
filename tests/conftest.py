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

import _cpu_report  # noqa: E402  (tests/_cpu_report.py: HPKIT_TEST_CPU_REPORT)
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


# A requeued job starts at the backfill scheduler's next pass: at Slurm's 30 s between passes, every requeue drill on
# the session clusters (preemption, hang budgets, sweeps) idled up to 30 s for it (a preempt test 125 -> 89 s at 1 s).
SESSION_BF_INTERVAL_S = 1


@pytest.fixture(scope="session")
def slurm_cluster_22_05(tmp_path_factory) -> dict[str, str]:
    """Start a 2-node x 2-CPU cluster of the host's Slurm (22.05) for this test session; returns the
    environment for clients, which is also this process's for the session (SLURM_CONF, PYTHONPATH)."""
    if shutil.which("slurmctld") is None:
        pytest.fail("slurmctld not found: `make test` installs slurm-wlm; run it, or `make system-deps`")
    # Not a developer's `make cluster-up` cluster, nor another xdist worker's: its own directory,
    # ports and job ids.
    env = devcluster.client_env(
        tmp_path_factory.mktemp("slurm-cluster"), *slot("session"), bf_interval=SESSION_BF_INTERVAL_S
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


@pytest.fixture(scope="session")
def slurm_cluster_24_11(tmp_path_factory) -> dict[str, str]:
    """The same cluster under Slurm 24.11 (HyperPod's), run from the trixie root that slurm/dev/slurm-root.sh
    builds once per machine (`make test` builds it first); its clients are the wrappers in <dir>/bin."""
    env = devcluster.client_env(
        tmp_path_factory.mktemp("slurm-24.11"),
        *slot("slurm-24.11"),
        slurm="24.11",
        bf_interval=SESSION_BF_INTERVAL_S,
    )
    # As HyperPod's recent clusters: topology/tree and a topology.conf that hpkit renders (test_slurm_topology).
    env["TOPOLOGY"] = "tree"
    try:
        devcluster.up(env)
    except devcluster.DevClusterError as exc:
        pytest.fail(str(exc))
    yield env
    devcluster.down(env)


@pytest.fixture(scope="session")
def slurm_cluster(request) -> dict[str, str]:
    """The session's local cluster: Slurm 22.05; a test marked `slurm_24_11` runs once on each version.

    Under 24.11 (function-scoped there, by the parametrization below) this process's SLURM_CONF, PATH and
    PYTHONPATH point at the 24.11 cluster for the test, so that `CliBackend()` and `hpkit` reach it too.
    """
    version = getattr(request, "param", "22.05")
    if version == "22.05":
        return request.getfixturevalue("slurm_cluster_22_05")
    env = request.getfixturevalue("slurm_cluster_24_11")
    patch = pytest.MonkeyPatch()
    for key in ("SLURM_CONF", "PATH", "PYTHONPATH"):
        patch.setenv(key, env[key])
    request.addfinalizer(patch.undo)
    return env


def pytest_configure(config):
    _cpu_report.register(config)
    config.addinivalue_line(
        "markers",
        "slurm_24_11: runs on the local cluster under Slurm 22.05 and again under 24.11 (HyperPod's)",
    )


def pytest_generate_tests(metafunc):
    """`@pytest.mark.slurm_24_11`: the test runs on the 22.05 cluster and again on the 24.11 one."""
    if metafunc.definition.get_closest_marker("slurm_24_11") and "slurm_cluster" in metafunc.fixturenames:
        metafunc.parametrize(
            "slurm_cluster",
            devcluster.SLURM_VERSIONS,
            indirect=True,
            scope="function",
            ids=lambda v: f"slurm{v}",
        )


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


# The files that take half a minute or more, longest first (their wall time in a fresh-clone `make test` of fb031c8,
# from HPKIT_TEST_CPU_REPORT): each worker takes the next file when it is done with one
# (tests/_file_schedule.py), so the run does not end on one long file while the other workers idle.
SLOW_FILES_FIRST = (
    "test_image_build.py",  # builds the CPU image and exports the OCI bundle that test_oci_jobs.py runs
    "test_node_loss.py",  # 459 s, mostly waiting on node-death detection and requeues
    "test_slurm_polling.py",  # 174 s, waiting on a stopped controller
    "test_smp_v2.py",
    "test_node_network.py",
    "test_install_paths.py",
    "test_forgotten_accounting.py",  # 2-2.5 min a Slurm version: node loss, preemption, slurmctld's purge
    "test_oci_jobs.py",  # about when the bundle is exported (its wait keeps a worker, not a core)
    "test_checkpoint_crash.py",
    "test_hang_recovery.py",
    "test_smp_jobs.py",
    "test_why_jobs.py",
    "test_sweep_jobs.py",
    "test_resilience.py",
    "test_hang_culprits.py",
    "test_plan_memory_measured.py",
    "test_stragglers.py",
    "test_slurm_jobs.py",
    "test_check_all_nodes.py",
    "test_training_resume.py",
    "test_sagemaker_smddp.py",
    "test_hostile_specs.py",
    "test_validation.py",
    "test_runtime_checkpoint.py",
    "test_training_correctness.py",
    "test_moe.py",
    "test_cluster_scale.py",
    "test_forgotten_job.py",
)


def _left_off_24_11(item) -> bool:
    """`@pytest.mark.slurm_24_11(launcher="torchrun")`: on 24.11, only the parameters named (fewer jobs)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or callspec.params.get("slurm_cluster") != "24.11":
        return False
    marker = item.get_closest_marker("slurm_24_11")
    return any(callspec.params.get(name) != value for name, value in marker.kwargs.items())


def pytest_collection_modifyitems(config, items):
    # The wide scale checks (32-64 torch processes, minutes) run only when asked; deselected, not skipped, so
    # that CI=true's rule above does not count them as checks that silently did not run.
    wide = os.environ.get("HPKIT_SCALE_TESTS") == "1"
    left_off = [
        item
        for item in items
        if _left_off_24_11(item) or (not wide and item.get_closest_marker("scale_wide"))
    ]
    if left_off:
        config.hook.pytest_deselected(items=left_off)
        items[:] = [item for item in items if item not in left_off]
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order otherwise kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # xdist's own loadfile scheduling would put the files in its order, not SLOW_FILES_FIRST's (tests/_file_schedule.py).
    import _file_schedule

    return _file_schedule.make_scheduler(config, log)
