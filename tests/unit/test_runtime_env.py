from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from hpkit.rendezvous import port_for_job
from hpkit.runtime.env import (
    LaunchError,
    expand_tasks_per_node,
    node_name,
    read_launch_env,
    threads_per_process,
)


def test_torchrun_variables_win():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29555",
        "TORCHELASTIC_RUN_ID": "x",
        # srun's variables are present too inside an allocation; they must not be used.
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    launch = read_launch_env(env, resolve_host=lambda _: pytest.fail("must not ask Slurm"))
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (3, 4, 1, 2)
    assert (launch.master_addr, launch.master_port, launch.source) == ("10.0.0.5", 29555, "torchrun")


def test_srun_fallback_uses_first_node_address():
    env = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "1234",
    }
    asked = []

    def resolve(nodelist: str) -> str:
        asked.append(nodelist)
        return "192.168.1.10"

    launch = read_launch_env(env, resolve_host=resolve)
    assert asked == ["node[1-2]"]
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (2, 4, 0, 2)
    assert launch.master_addr == "192.168.1.10"
    assert launch.master_port == port_for_job(1234) == 29500 + 1234 % 3000
    assert launch.source == "slurm"


def test_srun_in_a_step_on_some_of_the_allocations_nodes_rendezvous_on_the_steps_first_node():
    """`srun -w node2,node3` in a node[1-3] allocation: task 0 (rank 0, which serves the store) runs on node2, and
    the job's first node runs no task of the step. Asked for the job's list, every rank waited on node1."""
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_STEP_NODELIST": "node[2-3]",
        "SLURM_JOB_ID": "1234",
    }
    asked = []
    read_launch_env(env, resolve_host=lambda nodelist: asked.append(nodelist) or "10.0.0.2")
    assert asked == ["node[2-3]"]


def test_a_steps_tasks_on_this_node_come_from_the_step_not_the_allocation():
    """`srun -N2 -n2` in a --ntasks-per-node=2 job (22.05, measured): each task inherits SLURM_NTASKS_PER_NODE=2
    from the allocation, and SLURM_STEP_TASKS_PER_NODE says 1(x2). One rank a node: each gets the node's cores
    (and SMP's local_size() is 1), not half of them."""
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "MASTER_ADDR": "h",
    }
    assert read_launch_env(env).local_world_size == 1
    # A step of its own shape: 3 tasks on the first node, 1 on the second.
    env |= {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_TASKS_PER_NODE": "3,1"}
    assert read_launch_env(env).local_world_size == 1
    assert read_launch_env(env | {"SLURM_NODEID": "0", "SLURM_PROCID": "0"}).local_world_size == 3


def test_srun_with_exported_master_does_not_ask_slurm():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    launch = read_launch_env(env, resolve_host=lambda _: pytest.fail("must not ask Slurm"))
    assert (launch.master_addr, launch.master_port) == ("h", 1)


def test_single_process_without_any_launcher():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.source) == (0, 1, "single")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "outside the world"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "not an integer"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "SLURM_STEP_NODELIST is missing"),
    ],
)
def test_launch_errors_say_what_is_missing(env, message):
    with pytest.raises(LaunchError, match=message):
        read_launch_env(env)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError):
        expand_tasks_per_node("two")


def test_threads_split_cores_among_local_ranks():
    assert threads_per_process(4, cpu_count=16, affinity=16) == 4
    assert threads_per_process(4, cpu_count=2, affinity=2) == 1
    # Bound by the launcher to 3 cores: those are this rank's own.
    assert threads_per_process(4, cpu_count=16, affinity=3) == 3


def test_node_name_is_slurms_else_the_host_name():
    # The development cluster's nodes share one host name; Slurm's name tells them apart.
    assert node_name({"SLURMD_NODENAME": "node2", "HOSTNAME": "vm"}) == "node2"
    assert node_name({}) == socket.gethostname()


def test_in_an_oci_container_the_node_is_slurms_name_for_it_not_the_containers(tmp_path):
    # An OCI container's host name is the container's own: the hang watchdog named nodes by it, so its verdict
    # (and culprit_nodes, which the supervisor swaps for spares) named no node of the job.
    from hpkit.runtime.watchdog.hang_watchdog import HangWatchdog

    env = {"SLURM_TOPOLOGY_ADDR": "spine1.leaf3.node7", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
    assert node_name(env) == "node7"
    dotted = {"SLURM_TOPOLOGY_ADDR": "leaf3.ip-10-1-2-3.ec2", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.node"}
    assert node_name(dotted) == "ip-10-1-2-3.ec2"  # the pattern counts the switches; the node keeps its dots
    assert node_name({"SLURM_TOPOLOGY_ADDR": "node7"}) == "node7"  # no topology plugin: the node alone
    assert node_name({**env, "SLURMD_NODENAME": "node2"}) == "node2"
    # Slurm 22.05's OCI containers all get one node's environment (measured on the local cluster: node1's
    # SLURMD_NODENAME, SLURM_TOPOLOGY_ADDR and SLURM_NODEID on node2 too); the host name, one of the job's
    # nodes, is this node's.
    stale = {
        "SLURM_CONTAINER": "/b/hpkit-cpu",
        "SLURMD_NODENAME": "node1",
        "SLURM_TOPOLOGY_ADDR": "node1",
        "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
        "SLURM_STEP_NODELIST": "node[1-2]",
    }
    assert node_name(stale, host="node2") == "node2"
    assert node_name(stale, host="node2.cluster.internal") == "node2"
    assert node_name(stale, host="node1") == "node1"
    # The development cluster's nodes share one host name, which is no node's: Slurm's name stands.
    assert node_name(stale, host="vm") == "node1"
    assert node_name({k: v for k, v in stale.items() if k != "SLURM_CONTAINER"}, host="node2") == "node1"
    watchdog = HangWatchdog(tmp_path / "hangs", 0, 1, 10, 10, env={**env, "HPKIT_WATCH_BOARD": str(tmp_path)})
    assert watchdog.node == "node7"


def test_a_taken_master_port_is_one_line_naming_it(tmp_path):
    """Rank 0 cannot serve the rendezvous store on a port something else holds: one line, no traceback."""
    import os
    import subprocess
    import sys

    config = tmp_path / "c.yaml"
    config.write_text("name: port\ntrain: {steps: 1}\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("HPKIT_SPEC",)},
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        done = subprocess.run(
            [sys.executable, "-m", "hpkit", "train", "--config", str(config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"hpkit train: error: rank 0: MASTER_PORT {port} is already in use on 127.0.0.1: another job or "
        "program holds it; pick a free port (torchrun --standalone or --rdzv-endpoint HOST:0 chooses one)"
    ]


def test_groups_made_after_the_world_inherit_the_jobs_collective_timeout():
    # A DeviceMesh dimension or the checkpointer's gloo group got torch's 30-minute default, not
    # resilience.collective_timeout_s: a dead peer held such a collective for half an hour.
    script = (
        "import torch.distributed as dist\n"
        "from hpkit.runtime.env import DeviceInfo, LaunchEnv, init_distributed\n"
        "launch = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr='127.0.0.1',"
        " master_port=1, source='test')\n"
        "init_distributed(launch, DeviceInfo('cpu', None, 'gloo', 'cpu'), timeout_s=42)\n"
        "group = dist.new_group(backend='gloo')\n"
        "import torch\n"
        "print(group._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "42.0"


def test_the_first_nodes_address_is_its_nodeaddr_from_one_scontrol_call(tmp_path, monkeypatch):
    """The host list is read in Python (hpkit.slurm.hostlist): scontrol is asked only for the first node's record."""
    from hpkit.runtime.env import slurm_first_node_addr

    calls = tmp_path / "calls"
    (tmp_path / "scontrol").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\necho "NodeName=$4 Arch=x86_64 NodeAddr=10.1.0.7 NodeHostName=$4"\n'
    )
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert slurm_first_node_addr("gpu-[007-010],login1") == "10.1.0.7"
    assert calls.read_text().splitlines() == ["show node -o gpu-007"]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with pytest.raises(
        LaunchError, match=r"^scontrol is not on PATH: export MASTER_ADDR and MASTER_PORT instead$"
    ):
        slurm_first_node_addr("node1")
