"""What the warm-start client and its node's zygote agree on: where the socket is, how a message is framed, and
which commands and environments a zygote may start warm. Standard library only: the client imports it."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT_ENV = "HPKIT_WARM_ROOT"  # another folder for the sockets (tests; hosts without /dev/shm)
# The socket itself, named outright: a zygote outside a Slurm job (a launcher of its own, the test suite's warm
# launches). Its folder must still be the user's alone.
SOCKET_ENV = "HPKIT_WARM_SOCKET"
# A zygote's whole request (argv, environment) fits one datagram of this size; a larger one starts cold.
MAX_MESSAGE = 1 << 20
# What the interpreter reads when it starts or when a library loads (not later): a rank whose values differ from
# the zygote's would not be the process a cold start makes, so it starts cold. Every PYTHON* variable counts too.
STARTUP_VARS = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
)


# The exit status of a client whose rank stays in its process for the next step (hpkit.warm.park): its launcher
# sees its rank end, as a failed one, and ends its step without waiting for a process that will not end.
STAYED_EXIT = 86

_READY = re.compile(r"hpkit: warm: (\S+) ready in ")


def ready_line(node: str, seconds: float, preloaded: str, threads: int) -> str:
    """What a zygote says once its socket listens. The job's supervisor waits for it (ready_node) before the
    first step, so that that step's ranks fork too."""
    return f"hpkit: warm: {node} ready in {seconds:.1f} s ({preloaded or 'nothing'} imported; {threads} thread(s))"


def ready_node(line: str) -> str | None:
    """The node a zygote's ready line names (srun's task label before it, if any); None for any other line."""
    match = _READY.search(line)
    return match.group(1) if match else None


def socket_path(env: Mapping[str, str]) -> Path | None:
    """The zygote's socket for this job on this node, in node-local memory; None outside a Slurm job, unless
    SOCKET_ENV names it.

    Keyed by job and node: the nodes of a local cluster share one /dev/shm."""
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV])
    job, node = env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME")
    if not job or not node:
        return None
    if env.get(ROOT_ENV):
        base = Path(env[ROOT_ENV])
    elif os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = Path(os.environ.get("TMPDIR") or "/tmp")
    return base / f"hpkit-warm-{os.getuid()}" / f"{job}-{node}.sock"


def private_folder(folder: Path, create: bool) -> bool:
    """Whether `folder` is this user's alone (mode 0700, owned by us); with `create`, made so first. Only then may
    its socket be trusted: a zygote runs whatever its clients ask, as its user."""
    if create:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o077 == 0


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that a started interpreter has already read (STARTUP_VARS, PYTHON*)."""
    return {k: v for k, v in env.items() if k in STARTUP_VARS or k.startswith("PYTHON")}


def env_difference(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The start-up variables whose values differ between two environments, sorted."""
    a, b = startup_env(mine), startup_env(theirs)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def python_target(argv: Sequence[str], executable: str) -> list[str] | None:
    """What a command runs when it is `executable -m MODULE ARGS` or `executable SCRIPT ARGS` (["-m", MODULE, ...]
    or [SCRIPT, ...]); None for anything else (another interpreter, interpreter options), which starts cold.

    The same interpreter means the same path, or the same file in the same folder (a venv's python and python3):
    a venv's python is a link to the system's, whose realpath alone would not tell the two apart."""
    if len(argv) < 2 or not _same_interpreter(argv[0], executable):
        return None
    rest = list(argv[1:])
    if rest[0] == "-m":
        return rest if len(rest) >= 2 else None
    if rest[0].startswith("-"):
        return None
    return rest


def _same_interpreter(program: str, executable: str) -> bool:
    if not executable:
        return False
    path = program if "/" in program else _which(program)
    if path is None:
        return False
    path, executable = os.path.abspath(path), os.path.abspath(executable)
    if path == executable:
        return True
    return os.path.dirname(path) == os.path.dirname(executable) and os.path.realpath(
        path
    ) == os.path.realpath(executable)


def _which(program: str) -> str | None:
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder or ".", program)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) when the other side has closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)
