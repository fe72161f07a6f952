"""slurm/dev/up.sh and down.sh: idempotent start, and a stop that touches only what it started."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from _clusters import slot
from hpkit import devcluster

pytestmark = pytest.mark.cluster


def run(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=120)


def pids(state: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in sorted((state / "run").glob("*.pid"))}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_up_is_idempotent_and_down_stops_only_its_own_daemons(repo, tmp_path):
    state = tmp_path / "c"
    env = devcluster.client_env(state, *slot("dev-cluster"), nodes=3, cpus=1)
    # A process that merely carries a daemon's name must survive the tear-down.
    decoy = subprocess.Popen(["bash", "-c", "exec -a slurmd sleep 120"])
    try:
        first = run(repo / "slurm/dev/up.sh", env)
        assert first.returncode == 0, first.stderr
        assert "3 nodes ready" in first.stdout
        started = pids(state)
        assert set(started) == {"munged", "slurmctld", "slurmd-node1", "slurmd-node2", "slurmd-node3"}
        assert all(alive(p) for p in started.values())
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %c"], env=env, capture_output=True, text=True)
        assert sinfo.stdout.split("\n")[:3] == ["node1 1", "node2 1", "node3 1"]

        again = run(repo / "slurm/dev/up.sh", env)
        assert again.returncode == 0, again.stderr
        assert pids(state) == started, "a second up must leave the running daemons alone"

        down = run(repo / "slurm/dev/down.sh", env)
        assert down.returncode == 0, down.stderr
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in started.values())
        assert pids(state) == {}
        assert decoy.poll() is None, "down.sh killed a process it did not start"
    finally:
        decoy.kill()
        run(repo / "slurm/dev/down.sh", env)


def test_bad_settings_are_refused_with_the_fix(repo, tmp_path):
    env = {**os.environ, "HPKIT_DEV_CLUSTER_DIR": str(tmp_path / "c"), "NODES": "two"}
    proc = run(repo / "slurm/dev/up.sh", env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "cluster-up: NODES must be a positive integer, not 'two'"
    assert not (tmp_path / "c").exists()


def test_a_port_another_process_holds_is_named_with_its_holder_before_anything_starts(repo, tmp_path):
    # A cluster left running by a killed test run holds its ports, and a new cluster on them failed with "Address
    # already in use" only in slurmctld's log. Here this test's own listener holds node2's port.
    import socket

    state = tmp_path / "c"
    env = devcluster.client_env(state, *slot("dev-cluster"), nodes=2, cpus=1)
    port = int(env["HPKIT_DEV_PORT"]) + 2
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", port))
        holder.listen()
        try:
            proc = run(repo / "slurm/dev/up.sh", env)
            assert proc.returncode == 1, proc.stdout
            # The refusal is the last line (a deep TMPDIR, as make test's, adds a warning about the folder first).
            line = proc.stderr.strip().splitlines()[-1]
            assert line.startswith(
                f"cluster-up: port {port} (slurmd of node2) is taken by pid {os.getpid()}: "
            ), line
            assert "choose another HPKIT_DEV_PORT" in line, line
            assert pids(state) == {}, "something started before the check"
        finally:
            run(repo / "slurm/dev/down.sh", env)


# A bench or script holding a cluster for its body, then stopped as a `timeout` wrapper or a CI runner stops it.
_HOLDS_A_CLUSTER = """
import sys, time
from hpkit import devcluster
env = devcluster.client_env(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), nodes=1, cpus=1)
with devcluster.running(env):
    print("up", flush=True)
    time.sleep(300)
"""


def test_a_script_stopped_by_sigterm_inside_running_takes_its_cluster_down(repo, tmp_path):
    """Without the handler, Python ends at SIGTERM without running `finally`, and munged, slurmctld and slurmd
    outlive the script (a bench stopped by its wrapper left them so)."""
    import signal
    import sys

    state = tmp_path / "c"
    port, first_job_id = slot("dev-cluster")
    env = {**os.environ, "PYTHONPATH": str(repo / "python")}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_A_CLUSTER, str(state), str(port), str(first_job_id)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "up", holder.stderr.read()
        started = pids(state)
        assert started and all(alive(p) for p in started.values())
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=120) == 143
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in started.values()), pids(state)
    finally:
        holder.kill()
        run(repo / "slurm/dev/down.sh", devcluster.client_env(state, port, first_job_id, nodes=1, cpus=1))
