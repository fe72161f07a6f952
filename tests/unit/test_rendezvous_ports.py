"""Job rendezvous ports and local launch ports both stay below Linux's ephemeral range."""

from __future__ import annotations

import socket

from hpkit.rendezvous import LOCAL_PORTS, PORT_BASE, PORT_SPAN, free_local_ports, port_for_job

EPHEMERAL_FIRST = 32768  # Linux's default ip_local_port_range starts here


def test_job_ports_never_reach_the_ephemeral_range():
    assert (
        max(port_for_job(job_id) for job_id in range(0, 3 * PORT_SPAN))
        == PORT_BASE + PORT_SPAN - 1
        < EPHEMERAL_FIRST
    )
    assert port_for_job(12_345_678) == PORT_BASE + 12_345_678 % PORT_SPAN


def test_local_ports_are_free_consecutive_and_apart_from_job_ports():
    first = free_local_ports(2)
    assert first in LOCAL_PORTS and first + 1 in LOCAL_PORTS and first + 1 < PORT_BASE
    with socket.socket() as a, socket.socket() as b:
        a.bind(("", first))
        b.bind(("", first + 1))
