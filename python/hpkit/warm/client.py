"""`python -m hpkit.warm.client -- COMMAND...`: COMMAND, started warm by the node's zygote (hpkit.warm.zygote)
where one answers, else exactly as `exec COMMAND`.

The launcher (torchrun's agent, or srun's task under launcher srun or mpi) starts this in the rank's place. It connects to the zygote of its job on its node
over a unix socket, hands it the command, its environment, its folder, its CPUs (affinity) and its stdin, stdout and stderr (the
descriptors themselves), then stands for the rank: every signal it receives goes to the rank, and it exits
with the rank's exit status, or dies of the signal that killed the rank. The zygote SIGKILLs the rank when this
process's connection closes (it was SIGKILLed, its step cancelled), so no rank outlives its step unless it stays
for the next one (hpkit.warm.park), whose client the zygote then answers with that process; and this
process dies of SIGKILL when the zygote goes (the node's rank processes with it).

No zygote, or one that cannot start this command warm (another interpreter, a start-up variable that differs,
threads in the zygote): the command is exec'ed here, cold, with one line saying why when a zygote refused.
Standard library only, and nothing of hpkit's but the protocol: it runs in the cold start's place.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

from hpkit.warm.protocol import private_folder, receive, send, socket_path

PR_SET_PDEATHSIG = 1
# The signals passed on to the rank: every one a process can catch and whose default is to end it (or that a
# program may handle: USR1 asks hpkit train to checkpoint and stop), not those that stop or continue it.
RELAYED = tuple(
    s
    for s in (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGWINCH,
    )
)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m hpkit.warm.client -- COMMAND [ARGS...]")
    parent = os.getppid()
    sock = connect(socket_path(os.environ))
    if sock is None:
        cold(argv, None)
    # Its launcher may itself be a zygote's fork (torchrun's agent, warm), outside the step's processes that Slurm
    # ends: when it goes, this process goes, and so its rank.
    die_with(parent)
    # Signals that reach this process before the rank exists are kept and passed on once it does: its start
    # must not be able to lose one (the zygote reads them after the request, so after the fork).
    # What this process's parent left ignored stays ignored in the rank, as across an exec.
    ignored = [
        int(s)
        for s in signal.valid_signals()
        if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) == signal.SIG_IGN
    ]
    relay = _Relay(sock)
    for s in RELAYED:
        if s not in ignored:
            signal.signal(s, relay.handle)
    request = {
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "ignored_signals": ignored,
        "umask": _umask(),
        # Slurm binds a step's tasks to their CPUs (task/affinity); the zygote's step has its own binding.
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    request["fds"] = fds
    try:
        send(sock, request, fds)
        reply, _ = receive(sock)
    except OSError:
        reply = None
    if reply is None or "pid" not in reply:
        for s in RELAYED:
            if s not in ignored:
                signal.signal(s, signal.SIG_DFL)
        sock.close()
        _death_signal(0)  # a cold rank is the launcher's child as without this client
        cold(argv, (reply or {}).get("cold", "the zygote closed the connection"))
    while True:
        try:
            message, _ = receive(sock)
        except InterruptedError:
            continue
        except OSError:
            message = None
        if message is None:  # the zygote is gone, and the rank with it (it dies with its parent)
            _die(signal.SIGKILL)
        if "exit" in message:
            sys.stdout.flush()
            os._exit(int(message["exit"]))
        if "signal" in message:
            _die(int(message["signal"]))


class _Relay:
    def __init__(self, sock: socket.socket):
        self.sock = sock

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):  # the zygote is gone: the receive loop learns it too
            send(self.sock, {"signal": signum})


def connect(path: Path | None) -> socket.socket | None:
    """A connection to the zygote at `path`, or None where there is none (or its folder is not ours alone)."""
    if path is None or not private_folder(path.parent, create=False):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(os.fspath(path))
    except OSError:
        sock.close()
        return None
    return sock


def die_with(parent: int) -> None:
    """SIGKILL this process when `parent` ends (PR_SET_PDEATHSIG); at once if it already has."""
    _death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        _die(signal.SIGKILL)


def _death_signal(signum: int) -> None:
    import ctypes  # only on the warm path

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)


def cold(argv: list[str], why: str | None) -> None:
    """Run the command here, as the launcher would have without this client."""
    if why:
        print(f"hpkit: warm start refused ({why}): starting cold", file=sys.stderr, flush=True)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.exit(f"hpkit.warm.client: cannot run {argv[0]}: {exc.strerror or exc}")


def _die(signum: int) -> None:
    """End as the rank ended: of the same signal (its default action), so the launcher sees what it would."""
    sys.stdout.flush()
    sys.stderr.flush()
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default action does not end the process


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    main(sys.argv[1:])
