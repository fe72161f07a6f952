"""The interface gloo and NCCL bind to: it must be the one that reaches the rendezvous.

A node with several interfaces (a second NIC, an unroutable one, a container bridge) makes gloo and NCCL
guess: gloo binds the address its hostname resolves to, NCCL prefers an ib* interface, and a wrong guess hangs
the first collective. The kernel's route to the rendezvous host names the right one (hpkit.rendezvous).
hpkit's own launches set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to it unless the job set them; this check
names the variable to set, in one line, where a value set, or a library's own choice, cannot reach.
"""

from __future__ import annotations

import socket

from hpkit import rendezvous
from hpkit.checks.context import Context
from hpkit.checks.registry import check
from hpkit.checks.result import Result
from hpkit.slurm import client, hostlist

PROFILES = ("compute", "container")
VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _address(host: str, ctx: Context) -> str | None:
    """The host's IPv4 address: the resolver's, else Slurm's NodeAddr for it (node names need not resolve)."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0])
    except OSError:
        pass
    out = client.show_node(host, ctx.env, ctx.probe_timeout)
    addr = client.node_addr(out.out) if out.ok else None
    if addr is None:
        return None
    try:
        return str(socket.getaddrinfo(addr, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0])
    except OSError:
        return None


def rendezvous_host(ctx: Context) -> tuple[str, str] | None:
    """(host, where it came from): MASTER_ADDR, else the first node srun's ranks meet on
    (rendezvous.rendezvous_nodelist)."""
    if ctx.env.get("MASTER_ADDR"):
        return ctx.env["MASTER_ADDR"], "MASTER_ADDR"
    found = rendezvous.rendezvous_nodelist(ctx.env)
    host = hostlist.first(found[1]) if found else None
    if found and host:
        return host, f"the {'step' if found[0] == 'SLURM_STEP_NODELIST' else 'job'}'s first node, {host}"
    return None


def _interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def _naive_choices(ctx: Context, right: str) -> list[str]:
    """What each library picks by itself where its variable is unset, when that is not `right`."""
    wrong = []
    if not ctx.env.get("GLOO_SOCKET_IFNAME"):
        # gloo binds the address the hostname resolves to.
        try:
            own = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)[0][4][0]
        except OSError:
            own = None
        if own is not None and rendezvous.interface_with_address(str(own)) != right:
            wrong.append(f"gloo would bind {own} (the hostname's address)")
    if not ctx.env.get("NCCL_SOCKET_IFNAME"):
        ib = [n for n in _interface_names() if n.startswith("ib") and n != right]
        if ib:
            wrong.append(f"NCCL would prefer {ib[0]}")
    return wrong


def reaches(name: str, value: str, right: str) -> bool:
    """Whether the variable's value lets its library use interface `right`.

    GLOO_SOCKET_IFNAME: interface names, comma-separated. NCCL_SOCKET_IFNAME: prefixes; '=' makes them exact
    names, '^' a list to leave out."""
    if name.startswith("GLOO"):
        return right in value.split(",")
    if value.startswith("^"):
        return not any(right.startswith(p) for p in value[1:].lstrip("=").split(",") if p)
    if value.startswith("="):
        return right in value[1:].split(",")
    return any(right.startswith(p) for p in value.split(",") if p)


def _setting(right: str) -> str:
    return f"GLOO_SOCKET_IFNAME={right} NCCL_SOCKET_IFNAME=={right}"


@check("socket-ifname", "gloo/NCCL interface reaches the rendezvous", PROFILES)
def check_socket_ifname(ctx: Context) -> Result:
    found = rendezvous_host(ctx)
    if found is None:
        return Result.skip(
            "no rendezvous to reach: not in a Slurm job and MASTER_ADDR unset",
            "run it on the nodes (hpkit check --all-nodes), or set MASTER_ADDR to the rendezvous host",
        )
    host, source = found
    address = _address(host, ctx)
    if address is None and source != "MASTER_ADDR":
        return Result.skip(
            f"cannot tell the address of {source}: neither the resolver nor scontrol gives one",
            "set MASTER_ADDR to the rendezvous host's address to check the route to it",
        )
    if address is None:
        return Result.fail(
            f"cannot resolve the rendezvous host {host} ({source})",
            f"give {host} an address the nodes resolve (/etc/hosts, DNS) or set MASTER_ADDR to its IP",
        )
    if address.startswith("127."):
        return Result.ok(f"the rendezvous ({source}) is on loopback {address}: one host, nothing to choose")
    right = rendezvous.interface_toward(address)
    if right is None:
        return Result.fail(
            f"no interface of this node routes to the rendezvous {address} ({source})",
            "bring up the node's cluster network, or set MASTER_ADDR to an address this node reaches",
        )
    for name in VARIABLES:
        value = ctx.env.get(name, "")
        if value and not reaches(name, value, right):
            setting = f"{name}={'=' if name.startswith('NCCL') else ''}{right}"
            return Result.fail(
                f"{name}={value} cannot reach the rendezvous {address} ({source}); {right} does: set {setting}",
                f"export {setting} (or unset {name}: hpkit's launches pick the interface that routes to the "
                "rendezvous)",
            ).with_facts(socket_ifname=right)
    naive = _naive_choices(ctx, right)
    if naive:
        return Result.warn(
            f"{'; '.join(naive)}, but only {right} reaches the rendezvous {address}: hpkit's launches set "
            f"the variables; other launches: set {_setting(right)}",
            f"export {_setting(right)} in jobs that hpkit does not launch",
        ).with_facts(socket_ifname=right)
    return Result.ok(f"{right} reaches the rendezvous {address} ({source})").with_facts(socket_ifname=right)
