"""hpkit.devcluster: the private cluster's client environment, and a start that fails in one line."""

from __future__ import annotations

import os

import pytest

from hpkit import devcluster


def test_client_env_points_the_scripts_and_clients_at_one_private_cluster(tmp_path):
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere"}
    env = devcluster.client_env(tmp_path / "c", 7917, 9000, nodes=3, cpus=1, base=base)
    assert {
        k: env[k] for k in ("HPKIT_DEV_CLUSTER_DIR", "HPKIT_DEV_PORT", "FIRST_JOB_ID", "NODES", "CPUS")
    } == {
        "HPKIT_DEV_CLUSTER_DIR": str(tmp_path / "c"),
        "HPKIT_DEV_PORT": "7917",
        "FIRST_JOB_ID": "9000",
        "NODES": "3",
        "CPUS": "1",
    }
    # up.sh writes the config here; sbatch and squeue must read the same one.
    assert env["SLURM_CONF"] == str(tmp_path / "c" / "etc" / "slurm.conf")
    # Jobs import this checkout's hpkit before anything else on the path.
    assert env["PYTHONPATH"].split(os.pathsep) == [str(devcluster.PYTHON_DIR), "/elsewhere"]
    assert (devcluster.PYTHON_DIR / "hpkit" / "devcluster.py").is_file()
    assert env["PATH"] == "/usr/bin"
    assert base == {"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere"}, "the base environment must not change"


def test_a_cluster_that_cannot_start_is_one_line_naming_the_setting(tmp_path):
    env = devcluster.client_env(tmp_path / "c", 7917, 9000, nodes=0)
    with pytest.raises(devcluster.DevClusterError) as err:
        devcluster.up(env)
    assert str(err.value) == (
        "the local cluster did not come up: cluster-up: NODES must be a positive integer, not '0'"
    )
    assert not (tmp_path / "c").exists()


def test_memory_kill_is_opt_in(tmp_path):
    assert "MEMORY_KILL" not in devcluster.client_env(tmp_path / "c", 7917, 9000, base={})
    assert devcluster.client_env(tmp_path / "c", 7917, 9000, base={}, memory_kill=True)["MEMORY_KILL"] == "1"


def test_oci_conf_runs_runc_per_node_job_step_and_task():
    """slurm/dev/up.sh writes oci.conf beside slurm.conf; nodes share one host, so ids name all four."""
    text = (devcluster.DEV_DIR / "oci.conf.in").read_text()
    lines = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert set(lines) == {"RunTimeQuery", "RunTimeKill", "RunTimeDelete", "RunTimeRun"}
    for value in lines.values():
        assert value.startswith('"runc --root=@DIR@/run/runc ') and "%n.%j.%s.%t" in value
    assert lines["RunTimeRun"].endswith(' -b %b"')
    assert 'oci.conf.in" >"$dir/etc/oci.conf"' in (devcluster.DEV_DIR / "up.sh").read_text()


def test_a_24_11_cluster_puts_its_command_wrappers_first_on_path(tmp_path):
    env = devcluster.client_env(tmp_path / "c", 7917, 9000, base={"PATH": "/usr/bin"}, slurm="24.11")
    assert env["SLURM"] == "24.11"
    assert env["PATH"].split(os.pathsep) == [str(tmp_path / "c" / "bin"), "/usr/bin"]
    assert devcluster.client_env(tmp_path / "c", 7917, 9000, base={"PATH": "/usr/bin"})["SLURM"] == "22.05"
    with pytest.raises(
        devcluster.DevClusterError, match=r"slurm must be one of 22\.05, 24\.11, not '23\.02'"
    ):
        devcluster.client_env(tmp_path / "c", 7917, 9000, slurm="23.02")


def test_the_24_11_wrappers_run_slurms_command_inside_the_root():
    """slurm/dev/in-root.sh: inside the root (a job step) the command itself; from the host, a private mount
    namespace, the binds, chroot."""
    text = (devcluster.DEV_DIR / "in-root.sh").read_text()
    assert '[[ -e /etc/hpkit-slurm-root ]] && in_root "$@"' in text
    assert 'exec unshare --mount -- "$0" "$@"' in text
    assert "etc/hpkit-slurm-root" in (devcluster.DEV_DIR / "slurm-root.sh").read_text()


def test_net_layout_reaches_the_scripts_and_a_wrong_one_is_refused(tmp_path):
    assert devcluster.client_env(tmp_path, 6817, 1, base={})["NET"] == "loopback"
    assert devcluster.client_env(tmp_path, 6817, 1, base={}, net="netns")["NET"] == "netns"
    with pytest.raises(devcluster.DevClusterError, match="net must be one of loopback, netns"):
        devcluster.client_env(tmp_path, 6817, 1, net="bridge")


def test_a_fault_helper_on_a_loopback_cluster_is_one_line(tmp_path):
    env = devcluster.client_env(tmp_path, 6817, 1, base={})
    with pytest.raises(devcluster.DevClusterError, match="is not a NET=netns cluster"):
        devcluster.cut(env, "node1")
