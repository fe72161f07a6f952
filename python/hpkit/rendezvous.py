"""The rendezvous port rule: one place, read by the sbatch template (as shell arithmetic) and the runtime; the
node srun's ranks meet on without MASTER_ADDR (read by the runtime and the checker); and free ports for launches on
one host (tests, benches).

Every task of a job must agree on the port without talking first, and jobs sharing a node must not
collide, so the port is derived from the job id. Torch-free and import-light.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping

PORT_BASE = 29500
# 29500-32499: below Linux's ephemeral ports (ip_local_port_range starts at 32768), which any outgoing
# connection or gloo/NCCL socket on the node may hold, so that one cannot take a job's port. Two jobs
# sharing a node collide only when their ids differ by a multiple of 3000.
PORT_SPAN = 3000
# Where there is no job id to derive from (a bare launch outside Slurm).
DEFAULT_PORT = PORT_BASE


def port_for_job(job_id: str | int | None) -> int:
    """The port for a Slurm job id; the default where the id is missing or not a number."""
    text = str(job_id) if job_id is not None else ""
    return PORT_BASE + int(text) % PORT_SPAN if text.isdigit() else DEFAULT_PORT


def rendezvous_nodelist(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, host list) whose first node srun's ranks meet on where MASTER_ADDR is not set: their step's, where
    task 0 (rank 0, which serves the store) runs, else the allocation's. A step on some of the allocation's nodes
    (srun -w, --exclude, fewer -N) need not include the allocation's first node. None outside Slurm."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return name, env[name]
    return None


def port_shell_expression(job_id_var: str = "SLURM_JOB_ID") -> str:
    """The same rule as bash arithmetic, for scripts that learn the job id only when they run."""
    return f"$(({PORT_BASE} + {job_id_var} % {PORT_SPAN}))"


# Ports for launches on one host (tests, benches, a bare local run): below the job ports and below Linux's
# ephemeral range. A port from bind(port 0) is ephemeral: between the probe and the launch binding it, any
# outgoing connection on the host (gloo opens many) may be given it, and the launch then fails EADDRINUSE.
LOCAL_PORTS = range(20000, PORT_BASE - 1)


def free_local_ports(count: int = 1) -> int:
    """The first of `count` consecutive ports free on this host now, drawn at random from LOCAL_PORTS."""
    draw = random.SystemRandom()
    for _ in range(500):
        first = draw.randrange(LOCAL_PORTS.start, LOCAL_PORTS.stop - count + 1)
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("", first + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return first
    raise RuntimeError(f"no {count} consecutive free port(s) in {LOCAL_PORTS.start}-{LOCAL_PORTS.stop - 1}")


# Which interface reaches the rendezvous. A node with several interfaces (a second NIC, a container bridge, an
# unroutable one) makes gloo and NCCL guess, and a wrong guess hangs the first collective; the kernel's route to
# the rendezvous host already knows the right one. Addresses are IPv4 (what a Slurm NodeAddr is here).
SIOCGIFADDR = 0x8915


def source_address(host: str) -> str | None:
    """This host's address that the kernel would send from toward `host` (no packet is sent); None if unrouted."""
    try:
        target = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # a UDP connect only picks the route and the source address
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The name of the local interface holding IPv4 `address` (its primary address), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def interface_toward(host: str) -> str | None:
    """The interface whose address routes to `host`; None for loopback (one host: nothing to choose) or no route."""
    source = source_address(host)
    if source is None or source.startswith("127."):
        return None
    return interface_with_address(source)


def socket_ifname_env(master_addr: str, env: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for a rank, naming the interface that reaches `master_addr`.

    Only those the user left unset; nothing where the rendezvous is on loopback or unrouted. NCCL reads its
    value as a prefix unless it starts with '=' (eth1 would also match eth10), so it gets the exact form."""
    wanted = [key for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(key)]
    name = interface_toward(master_addr) if wanted else None
    if name is None:
        return {}
    return {key: f"={name}" if key.startswith("NCCL") else name for key in wanted}
