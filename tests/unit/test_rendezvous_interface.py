"""The socket interface a rank is told to use: the one whose address routes to the rendezvous."""

from __future__ import annotations

import socket

import pytest

from hpkit import rendezvous
from hpkit.rendezvous import interface_toward, interface_with_address, socket_ifname_env, source_address


def test_loopback_has_no_interface_to_choose():
    assert source_address("127.0.0.1") == "127.0.0.1"
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_toward("127.0.0.1") is None
    assert socket_ifname_env("127.0.0.1", {}) == {}


def test_an_unresolvable_host_sets_nothing():
    assert source_address("no-such-host.invalid") is None
    assert socket_ifname_env("no-such-host.invalid", {}) == {}


def test_the_routed_interface_is_named_for_gloo_and_exactly_for_nccl(monkeypatch):
    monkeypatch.setattr(rendezvous, "interface_toward", lambda host: "eth1" if host == "10.0.0.2" else None)
    assert socket_ifname_env("10.0.0.2", {}) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"GLOO_SOCKET_IFNAME": "ens5"}, {"NCCL_SOCKET_IFNAME": "=eth1"}),
        ({"NCCL_SOCKET_IFNAME": "^docker"}, {"GLOO_SOCKET_IFNAME": "eth1"}),
        ({"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens5"}, {}),
    ],
)
def test_what_the_user_named_is_kept(monkeypatch, env, expected):
    monkeypatch.setattr(rendezvous, "interface_toward", lambda host: "eth1")
    assert socket_ifname_env("10.0.0.2", env) == expected


def test_the_interface_of_this_hosts_own_address():
    # Any address this host sends from (the route toward a documentation address, none sent) is its own.
    source = source_address("192.0.2.10")
    if source is None or source.startswith("127."):
        pytest.skip("no route off loopback on this host")
    name = interface_with_address(source)
    assert name in {n for _, n in socket.if_nameindex()}
    assert interface_toward("192.0.2.10") == name
