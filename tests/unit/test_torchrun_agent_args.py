"""hpkit-torchrun's decisions made before torch starts: who hosts the store, and torchrun's --rdzv-conf."""

from __future__ import annotations

import pytest

from hpkit.torchrun_agent import done_key, hosts_store, with_is_host


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HPKIT_RDZV_NODE": "node1", "SLURMD_NODENAME": "node1"}, True),
        ({"HPKIT_RDZV_NODE": "node1", "SLURMD_NODENAME": "node2"}, False),
        ({"SLURMD_NODENAME": "node1"}, None),  # not rendered by hpkit: torchrun decides as it always does
        ({"HPKIT_RDZV_NODE": "node1"}, None),  # no Slurm node name (an OCI container): the same
        ({"HPKIT_RDZV_NODE": "", "SLURMD_NODENAME": "node1"}, None),
    ],
)
def test_only_the_named_node_hosts_the_store(env, expected):
    assert hosts_store(env) is expected


@pytest.mark.parametrize(
    ("conf", "is_host", "expected"),
    [
        ("", True, "is_host=true"),
        ("read_timeout=120", False, "read_timeout=120,is_host=false"),
        (
            "is_host=true,read_timeout=120",
            False,
            "read_timeout=120,is_host=false",
        ),  # the job script's choice wins
        (" is_host = 1 ,", True, "is_host=true"),
    ],
)
def test_rdzv_conf_carries_the_decision(conf, is_host, expected):
    assert with_is_host(conf, is_host) == expected


def test_each_rendezvous_counts_its_own_agents():
    assert done_key("5010") != done_key("5011")
