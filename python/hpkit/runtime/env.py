"""Who this process is: rank, world, local rank and rendezvous address, from torchrun or from Slurm.

torchrun (and the srun launch of our sbatch template) export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*;
a bare `srun hpkit train` only has SLURM_* variables, so those are the fallback. Reading the
environment needs no torch; choosing the device does.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hpkit.errors import HpkitError
from hpkit.rendezvous import DEFAULT_PORT, port_for_job, rendezvous_nodelist, socket_ifname_env
from hpkit.slurm import client
from hpkit.slurm.hostlist import HostlistError, expand

SCONTROL_TIMEOUT_S = 20


class LaunchError(HpkitError):
    """The process was started without enough information to join the job's process group."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def node_name(env: Mapping[str, str] | None = None, host: str | None = None) -> str:
    """The node this process runs on, as Slurm names it; the host name outside Slurm. (Nodes of one
    host, as in the development cluster, share a host name but not a Slurm name.)

    In a Slurm OCI container (SLURM_CONTAINER) Slurm 22.05 hands every node's container the same environment
    (measured: SLURMD_NODENAME, SLURM_TOPOLOGY_ADDR and SLURM_NODEID of one node on both nodes of a job; 24.11
    gives each its own): there, a host name that is another of the job's nodes is this node's name (hpkit's
    bundles share the host's name). Else SLURMD_NODENAME, else the node that ends SLURM_TOPOLOGY_ADDR (the
    switches above it, then the node, joined by dots as SLURM_TOPOLOGY_ADDR_PATTERN says), else the host name."""
    env = os.environ if env is None else env
    host = socket.gethostname() if host is None else host
    named = env.get("SLURMD_NODENAME", "")
    if env.get("SLURM_CONTAINER") and host != named:
        nodes = expand(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
        short = host.split(".", 1)[0]
        if host in nodes or short in nodes:
            return host if host in nodes else short
    if named:
        return named
    addr = env.get("SLURM_TOPOLOGY_ADDR", "")
    if addr:
        # The pattern ("switch.switch.node") counts the parts: a node name may itself hold dots.
        pattern = env.get("SLURM_TOPOLOGY_ADDR_PATTERN", "")
        return addr.split(".", pattern.count("."))[-1] if pattern else addr.rsplit(".", 1)[-1]
    return host


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def read_launch_env(
    env: Mapping[str, str] | None = None, resolve_host: Callable[[str], str] | None = None
) -> LaunchEnv:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world = local_world_size(env)
        source = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        local_world = _slurm_local_world(env)
        source = "slurm"
    else:
        return LaunchEnv(
            0,
            1,
            0,
            1,
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", DEFAULT_PORT)),
            "single",
        )
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside the world of {world} processes")
    if world == 1:
        addr = env.get("MASTER_ADDR", "127.0.0.1")
    elif "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    else:
        found = rendezvous_nodelist(env)
        if found is None:
            raise LaunchError(
                "MASTER_ADDR is not set and SLURM_STEP_NODELIST is missing: launch with torchrun, or with srun "
                "inside a Slurm allocation, or export MASTER_ADDR/MASTER_PORT"
            )
        addr = (resolve_host or slurm_first_node_addr)(found[1])
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else port_for_job(env.get("SLURM_JOB_ID"))
    return LaunchEnv(rank, world, local_rank, max(local_world, local_rank + 1), addr, port, source)


def local_world_size(env: Mapping[str, str]) -> int:
    """This node's ranks: the launcher's LOCAL_WORLD_SIZE (torchrun), else the step's tasks on this node (srun).
    Read without asking Slurm anything (SMDDP's get_local_size() too)."""
    return _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else _slurm_local_world(env)


def _slurm_local_world(env: Mapping[str, str]) -> int:
    """This node's tasks in the step. The step's own count first: a step's tasks inherit the allocation's
    SLURM_NTASKS_PER_NODE (22.05, measured: `srun -N2 -n2` in a --ntasks-per-node=2 job gave each task 2, and
    SLURM_STEP_TASKS_PER_NODE 1(x2)), and SLURM_NODEID counts the step's nodes."""
    node = int(env.get("SLURM_NODEID", "0") or 0)
    step = env.get("SLURM_STEP_TASKS_PER_NODE")
    if step and node < len(counts := expand_tasks_per_node(step)):
        return counts[node]
    if "SLURM_NTASKS_PER_NODE" in env and env["SLURM_NTASKS_PER_NODE"].isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    tasks = env.get("SLURM_TASKS_PER_NODE")
    if tasks and node < len(counts := expand_tasks_per_node(tasks)):
        return counts[node]
    return 1


def expand_tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed form `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"cannot read the tasks-per-node value {value!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _scontrol(answer: client.Answer) -> str:
    """What scontrol printed, or a LaunchError saying why it could not be asked."""
    if answer.missing:
        raise LaunchError("scontrol is not on PATH: export MASTER_ADDR and MASTER_PORT instead")
    if answer.os_error:
        raise LaunchError(f"{answer.command} failed: {answer.os_error}")
    if answer.timed_out:
        raise LaunchError(f"{answer.command} took over {SCONTROL_TIMEOUT_S} s")
    if answer.rc != 0:
        raise LaunchError(f"{answer.command} failed: {answer.err.strip() or answer.rc}")
    return answer.out


def slurm_first_node_addr(nodelist: str) -> str:
    # A node name need not resolve in DNS; the node's NodeAddr is what slurmd itself is reached at.
    try:
        hosts = expand(nodelist)
    except HostlistError as exc:
        raise LaunchError(str(exc)) from None
    if not hosts:
        raise LaunchError(f"the node list {nodelist!r} names no node")
    record = _scontrol(client.show_node(hosts[0], timeout_s=SCONTROL_TIMEOUT_S))
    return client.node_addr(record) or hosts[0]


def threads_per_process(
    local_world_size: int, cpu_count: int | None = None, affinity: int | None = None
) -> int:
    """Intra-op threads for one rank: the cores it may use, shared among the ranks of its node.

    When a launcher has already bound the process to fewer cores than the machine has (srun
    --cpu-bind, cgroups), those cores are its own; otherwise the node's cores are split evenly.
    """
    cpu_count = cpu_count or os.cpu_count() or 1
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpu_count
    if affinity < cpu_count:
        return max(1, affinity)
    return max(1, cpu_count // max(1, local_world_size))


def configure_threads(launch: LaunchEnv, env: dict[str, str] | None = None) -> int:
    """Set OMP_NUM_THREADS (and torch's thread count) unless the user or torchrun already chose one."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        threads = int(env["OMP_NUM_THREADS"])
    else:
        threads = threads_per_process(launch.local_world_size)
        env["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    index: int | None
    backend: str  # "nccl" or "gloo"
    name: str

    def torch_device(self):
        import torch

        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)


def choose_device(launch: LaunchEnv) -> DeviceInfo:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        # With CUDA_VISIBLE_DEVICES narrowed per task (srun --gpus-per-task) each rank sees one GPU.
        index = launch.local_rank % count
        torch.cuda.set_device(index)
        return DeviceInfo("cuda", index, "nccl", torch.cuda.get_device_name(index))
    import platform

    return DeviceInfo("cpu", None, "gloo", platform.processor() or platform.machine() or "cpu")


def groups_inherit_timeout(timeout: Any) -> None:
    """Make the job's collective timeout the default of every process group made after the world's.

    torch gives a group made later (DeviceMesh's dimensions, the checkpointer's gloo group) its own default, 30
    minutes for gloo and 10 for NCCL, not the world's: a collective in one of them waited that long on a dead
    peer, and during a checkpoint save the hang watchdog (which holds its clock for saves) stayed quiet."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout


def init_distributed(launch: LaunchEnv, device: DeviceInfo, timeout_s: float = 600.0) -> None:
    """Join the process group (also for a world of one, so that every code path is the same)."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    kwargs = {}
    if device.type == "cuda":
        # Binding the device up front lets NCCL create communicators eagerly and fail fast.
        kwargs["device_id"] = device.torch_device()
    timeout = datetime.timedelta(seconds=timeout_s)
    if launch.world_size == 1:
        # No rendezvous for one process: an in-memory store never collides with another run's port.
        dist.init_process_group(
            device.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs
        )
        groups_inherit_timeout(timeout)
        return
    # env:// rather than tcp://: under torchrun the agent already serves the store on MASTER_PORT
    # (TORCHELASTIC_USE_AGENT_STORE), and only env:// knows to join it instead of binding the port again.
    os.environ["MASTER_ADDR"] = launch.master_addr
    os.environ["MASTER_PORT"] = str(launch.master_port)
    os.environ["RANK"] = str(launch.rank)
    os.environ["WORLD_SIZE"] = str(launch.world_size)
    os.environ["LOCAL_RANK"] = str(launch.local_rank)
    # gloo binds to the address its hostname resolves to (127.0.0.1 on many hosts: unreachable from the other
    # nodes) and NCCL to the first interface it likes: both are told the one that reaches the rendezvous,
    # found on this node, unless the user named one.
    os.environ.update(socket_ifname_env(launch.master_addr, os.environ))
    try:
        dist.init_process_group(backend=device.backend, init_method="env://", timeout=timeout, **kwargs)
        groups_inherit_timeout(timeout)
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        # Rank 0 serves the rendezvous store on MASTER_PORT; something else on its host holds that port.
        raise HpkitError(
            f"rank {launch.rank}: MASTER_PORT {launch.master_port} is already in use on {launch.master_addr}: "
            "another job or program holds it; pick a free port (torchrun --standalone or "
            "--rdzv-endpoint HOST:0 chooses one)"
        ) from None


@dataclass(frozen=True)
class Distributed:
    """What an entry point knows once it has joined the process group."""

    launch: LaunchEnv
    device: DeviceInfo
    threads: int


@contextlib.contextmanager
def distributed(
    timeout_s: float = 600.0,
    choose_backend: Callable[[LaunchEnv, DeviceInfo], DeviceInfo] | None = None,
    abort_on_error: bool = False,
) -> Iterator[Distributed]:
    """Join the job's process group for the body of a `with`, and leave it cleanly.

    Reads the launch environment, sets the intra-op threads, picks the device (and, through
    `choose_backend`, a backend other than the device's default), and initialises torch.distributed.
    A body that ends normally waits at a barrier so that every rank's last sends (pipeline stages,
    async checkpoints) land before any rank tears its communicators down; one that raises does not,
    since its peers may be gone (with `abort_on_error`, NCCL's communicators are aborted first).
    """
    import torch.distributed as dist

    launch = read_launch_env()
    threads = configure_threads(launch)
    device = choose_device(launch)
    if choose_backend is not None:
        device = choose_backend(launch, device)
    init_distributed(launch, device, timeout_s=timeout_s)
    try:
        yield Distributed(launch, device, threads)
        dist.barrier()
    except BaseException:
        if abort_on_error and dist.is_initialized() and dist.get_backend() == "nccl":
            # A rank that stays in its process (hpkit.runtime.stay) joins a new group next: a communicator whose
            # peer is gone can hold its destruction up, and aborted it lets go at once. (Not run on a GPU yet.)
            with contextlib.suppress(Exception):
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
