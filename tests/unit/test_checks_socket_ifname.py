"""The socket-ifname check's pure parts (a Slurm node list's first host, what an *_SOCKET_IFNAME value lets a
library use) and its verdicts where no interface is to be chosen. Its verdicts on nodes with several
interfaces run in network namespaces: tests/integration/test_node_network.py."""

from __future__ import annotations

import pytest

from hpkit.checks.context import Context
from hpkit.checks.network_ifname import check_socket_ifname, reaches
from hpkit.checks.result import Status
from hpkit.slurm import hostlist


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("node[3-5,9],gpu1", "node3"),
        ("gpu-[007-010]", "gpu-007"),
        ("ip-10-1-2-[3,4]-ib", "ip-10-1-2-3-ib"),
        ("a1,b2", "a1"),
        ("", None),
    ],
)
def test_the_first_host_of_a_node_list(nodelist, first):
    assert hostlist.first(nodelist) == first


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("GLOO_SOCKET_IFNAME", "eth0", True),
        ("GLOO_SOCKET_IFNAME", "ib0", False),
        ("GLOO_SOCKET_IFNAME", "ib0,eth0", True),
        ("GLOO_SOCKET_IFNAME", "eth", False),  # gloo takes names, not prefixes
        ("NCCL_SOCKET_IFNAME", "eth", True),  # NCCL: a prefix
        ("NCCL_SOCKET_IFNAME", "=eth0", True),
        ("NCCL_SOCKET_IFNAME", "=eth", False),
        ("NCCL_SOCKET_IFNAME", "ib", False),
        ("NCCL_SOCKET_IFNAME", "^ib,docker", True),
        ("NCCL_SOCKET_IFNAME", "^eth", False),
    ],
)
def test_what_a_socket_ifname_value_lets_the_library_use(name, value, ok):
    assert reaches(name, value, "eth0") is ok


def test_outside_a_job_without_master_addr_there_is_nothing_to_reach():
    result = check_socket_ifname(Context(profile="compute", env={}))
    assert result.status == Status.SKIP and "MASTER_ADDR" in result.detail


def test_in_a_step_the_rendezvous_host_is_the_steps_first_node_as_the_ranks_take_it():
    from hpkit.checks.network_ifname import rendezvous_host

    env = {"SLURM_JOB_NODELIST": "node[1-3]", "SLURM_STEP_NODELIST": "node[2-3]"}
    assert rendezvous_host(Context(profile="compute", env=env)) == ("node2", "the step's first node, node2")
    env = {"SLURM_JOB_NODELIST": "node[1-3]"}  # the batch script: no step yet
    assert rendezvous_host(Context(profile="compute", env=env)) == ("node1", "the job's first node, node1")


def test_a_rendezvous_on_loopback_passes_whatever_is_set():
    env = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "ib0"}
    assert check_socket_ifname(Context(profile="compute", env=env)).status == Status.PASS


def test_an_unresolvable_master_addr_is_one_line_naming_it():
    env = {"MASTER_ADDR": "no-such-host.invalid", "PATH": ""}
    result = check_socket_ifname(Context(profile="compute", env=env))
    assert result.status == Status.FAIL and "no-such-host.invalid" in result.detail
    assert "\n" not in result.detail + result.fix
