"""The rendezvous port rule: one place, read by the sbatch template (as shell arithmetic) and the runtime;
and free ports for launches on one host (tests, benches).

Every task of a job must agree on the port without talking first, and jobs sharing a node must not
collide, so the port is derived from the job id. Torch-free and import-light.
"""

from __future__ import annotations

import random
import socket

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
