"""`python -m hpkit.warm.zygote [--preload MODULE,...]`: a node's warm process for one job. It imports the
modules a rank needs (torch, hpkit's runtime) once, then forks a rank each time a client asks
(hpkit.warm.client), so a rank started or restarted on this node skips the interpreter's start and its imports.

One zygote per node of the allocation, spares included, started as a background step by the job's supervisor
(hpkit.supervise) and ended with the allocation. It serves a unix socket in node-local memory named by the job
and the node (hpkit.warm.protocol.socket_path), in a folder only its user can enter, and answers only its own
user. Each rank it forks:
- becomes the process the command would have been: the client's argv, environment, folder, umask, CPUs (the
  affinity Slurm's task/affinity gave the rank's task, not the zygote's own), stdin, stdout and stderr (passed
  as descriptors), signal dispositions, a session of its own, `__main__` fresh, and Python's and numpy's random
  state drawn again (they would otherwise repeat the zygote's in every rank);
- dies when the zygote does (PR_SET_PDEATHSIG), and is SIGKILLed when its client's connection closes (the client
  was killed, its step cancelled): no rank outlives its step, but one that stays (resilience.keep_survivors,
  hpkit.warm.park): it says on its channel that it may, is given PARK_WINDOW_S after its client went to park, and
  parked, is handed the next request for its command on this node instead of a fork (adopted), or ended after
  PARK_S;
- reports its exit status or the signal that ended it to the client, which ends the same way.

Forking after `import torch` is safe only while the zygote has no other thread and has not initialised CUDA (a
thread holding a lock at the fork leaves it held in the child forever; a CUDA context does not survive a fork).
Before each fork the zygote checks both and otherwise refuses, and the client starts the rank cold: no Python
thread but the main one (threading), no native thread beyond those its imports left (/proc/self/task; numpy's
OpenBLAS pool is the one measured, which stops itself in a fork's prepare handler), torch.cuda not initialised.
The zygote itself never touches CUDA. A command it cannot start as a cold start would (another interpreter,
interpreter options, a start-up variable such as PYTHONPATH or OMP_NUM_THREADS that differs) is refused alike.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import ctypes
import importlib
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hpkit.warm import park
from hpkit.warm.become import become
from hpkit.warm.protocol import (
    SOCKET_ENV,
    STAYED_EXIT,
    env_difference,
    private_folder,
    python_target,
    ready_line,
    receive,
    send,
    socket_path,
)

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# A rank that may stay (hpkit.warm.park) and whose client has gone has this long to park before it is killed: it
# may still be leaving its broken group when its step ends. One that is blocked in a collective that cannot be
# interrupted never parks, and the next step starts a new process in its place.
PARK_WINDOW_S = 10.0
# A parked rank that no step has adopted this long after its client went is ended: the next step's ranks were
# started otherwise (another command, fewer ranks on the node), or the job is ending.
PARK_S = 180.0


@dataclass
class _Rank:
    conn: socket.socket
    client: int  # the client's pid: the process the launcher started, and names in its reports
    pid: int | None = None
    channel: socket.socket | None = None  # to the forked rank (hpkit.warm.park)
    argv: list[str] = field(default_factory=list)
    what: str = ""  # how the lines name it: "rank N", or a module or script
    attempt: str = "?"
    may_stay: bool = False  # it said it can park (resilience.keep_survivors)
    parked_at: float | None = None  # when it parked (monotonic), until a step adopts it
    orphaned_at: float | None = None  # when its client went


def native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def can_bind(cpus: set[int]) -> bool:
    """Whether a fork of this process can run on exactly `cpus`: its step's cgroup (cpuset) must hold them all.
    Tried on this process, whose own binding (its task's, Slurm's task/affinity) is put back after."""
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
        return os.sched_getaffinity(0) == cpus
    except OSError:
        return False
    finally:
        os.sched_setaffinity(0, mine)


def cuda_initialised() -> bool:
    cuda = sys.modules.get("torch.cuda")
    return bool(cuda is not None and cuda.is_initialized())


class Zygote:
    def __init__(
        self,
        path: Path,
        say: Callable[[str], None],
        node: str = "",
        threads: int | None = None,
        park_window_s: float = PARK_WINDOW_S,
        park_s: float = PARK_S,
    ):
        self.path, self.say, self.node = path, say, node
        self.park_window_s, self.park_s = park_window_s, park_s
        self.env = dict(os.environ)  # what this interpreter started with (protocol.STARTUP_VARS)
        # What the preload left: forks may not find more (main: what hpkit's own preload left, so that threads a
        # user's warm_preload started refuse every fork).
        self.threads = native_threads() if threads is None else threads
        self.ranks: dict[int, _Rank] = {}  # by the connection's descriptor
        self.channels: dict[int, _Rank] = {}  # by the channel's descriptor
        self.stopping = False
        self.started = 0

    def refusal(self, request: dict[str, Any]) -> str | None:
        """Why this request cannot be started warm, or None."""
        argv = [str(a) for a in request.get("argv") or []]
        if python_target(argv, sys.executable) is None:
            return f"the command is not `{sys.executable} -m MODULE` or `{sys.executable} SCRIPT`"
        differ = env_difference(self.env, request.get("env") or {})
        if differ:
            return f"{', '.join(differ)} differ(s) from the zygote's"
        if threading.active_count() > 1:
            return f"the zygote runs {threading.active_count()} Python threads"
        if native_threads() > self.threads:
            return f"the zygote runs {native_threads()} threads, more than its imports left ({self.threads})"
        if cuda_initialised():
            return "the zygote has initialised CUDA"
        cpus = request.get("cpus")
        if cpus is not None and not can_bind(set(cpus)):
            return f"the zygote's step (its cgroup) does not hold all {len(cpus)} of its CPUs"
        return None

    # -- the loop -------------------------------------------------------------------------------------------

    def serve(self, ready: str = "") -> None:
        """Serve until a stop signal; `ready` is said once the socket listens (a client may connect from then)."""
        private_folder(self.path.parent, create=True)
        if not private_folder(self.path.parent, create=False):
            raise SystemExit(
                f"hpkit: warm: {self.path.parent} is not this user's alone (mode 0700): not serving"
            )
        remove_leftovers(self.path.parent)
        self.path.unlink(missing_ok=True)  # a socket left by an earlier run of this job (requeued)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(os.fspath(self.path))
        os.chmod(self.path, 0o600)
        listener.listen(64)
        if ready:
            self.say(ready)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for s in STOP_SIGNALS:
            signal.signal(s, self._stop)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "listen")
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self._own_fds = [listener.fileno(), wake_r, wake_w]
        try:
            while not self.stopping:
                for key, _ in self.selector.select(self._timeout()):
                    if key.data == "listen":
                        self._accept(listener)
                    elif key.data == "channel":
                        self._heard(key.fileobj)  # type: ignore[arg-type]
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            while os.read(wake_r, 512):
                                pass
                    else:
                        self._handle(key.fileobj)  # type: ignore[arg-type]
                self._reap()
                self._expire()
        finally:
            for rank in self.ranks.values():
                if rank.pid is not None:
                    with contextlib.suppress(OSError):
                        os.kill(rank.pid, signal.SIGKILL)
            self.path.unlink(missing_ok=True)

    def _stop(self, _signum: int, _frame: Any) -> None:
        self.stopping = True

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        client, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # the folder already keeps others out; this says so twice
            conn.close()
            return
        self.ranks[conn.fileno()] = _Rank(conn, client)
        self.selector.register(conn, selectors.EVENT_READ, "rank")

    def _handle(self, conn: socket.socket) -> None:
        rank = self.ranks[conn.fileno()]
        try:
            message, fds = receive(conn, max_fds=3)
        except (OSError, ValueError):
            message, fds = None, []
        if message is None:
            # The client is gone (killed, its step cancelled): so is its rank, unless it has parked or may still.
            rank.orphaned_at = time.monotonic()
            if rank.pid is not None and rank.parked_at is None:
                # One that may stay is told its step has ended (it may still be training, its group whole).
                with contextlib.suppress(OSError):
                    os.kill(rank.pid, park.STEP_ENDED_SIGNAL if rank.may_stay else signal.SIGKILL)
            self._forget(rank, keep_pid=True)
            return
        if rank.pid is None and "argv" in message:
            self._start(rank, message, fds)
        elif "signal" in message and rank.pid is not None and rank.parked_at is None:
            with contextlib.suppress(OSError):
                os.kill(rank.pid, int(message["signal"]))
        else:
            for fd in fds:
                os.close(fd)

    def _start(self, rank: _Rank, request: dict[str, Any], fds: list[int]) -> None:
        why = self.refusal(request)
        if why is None and len(fds) != len(request.get("fds") or []):
            why = "the client's stdin, stdout and stderr did not arrive"
        if why is not None:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                send(rank.conn, {"cold": why})
            self._forget(rank)
            return
        env = request.get("env") or {}
        argv = [str(a) for a in request["argv"]]
        target = python_target(argv, sys.executable) or ["?"]
        # A rank by its number; anything else (torchrun's agent) by its module or script.
        rank.what = f"rank {env['RANK']}" if "RANK" in env else target[1] if target[0] == "-m" else target[0]
        rank.argv, rank.attempt = argv, str(env.get("HPKIT_STEP_ATTEMPT", "?"))
        parked = self._parked_for(argv, env.get("RANK"))
        if parked is not None and self._adopt(parked, rank, request, fds):
            return
        self._end_leaving(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        zygote = os.getpid()
        # The rank waits for this pipe before it runs anything of the command: once the client has its pid. A
        # zygote that dies in between leaves the client without an answer, and it starts the command cold: the
        # command must not have begun here too.
        go_read, go_write = os.pipe()
        # The rank's channel (hpkit.warm.park): it says there whether it may stay, and when it has parked.
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            mine.close()
            park.attach(theirs)
            self._child(zygote, rank, request, fds, go_read)
        os.close(go_read)
        theirs.close()
        for fd in fds:
            os.close(fd)
        rank.pid, rank.channel = pid, mine
        self.channels[mine.fileno()] = rank
        self.selector.register(mine, selectors.EVENT_READ, "channel")
        self.started += 1
        # torchrun's reports name the process it started, the client: the line maps it to the rank's own.
        self.say(
            f"hpkit: warm start on {self.node}: {rank.what} (attempt {rank.attempt}) forked as "
            f"process {pid} for process {rank.client}"
        )
        try:
            send(rank.conn, {"pid": pid})
            os.write(go_write, b"go")
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        finally:
            os.close(go_write)

    def _parked_for(self, argv: list[str], rank: str | None) -> _Rank | None:
        """A parked rank that the request for `argv` can adopt (the same command; the same rank number first). Its
        old client may still wait: the old step's tasks can outlive the start of the next (srun killed, the step's
        cancel still under way; measured under torchrun after a rank's SIGKILL)."""
        parked = [
            r
            for r in self.ranks.values()
            if r.parked_at is not None and r.channel is not None and r.argv == argv
        ]
        same = [r for r in parked if r.what == f"rank {rank}"]
        return (same or parked or [None])[0]

    def _adopt(self, parked: _Rank, rank: _Rank, request: dict[str, Any], fds: list[int]) -> bool:
        """Hand `rank`'s request to a parked process, which becomes its rank; False (the request still to start)
        where the parked process cannot take it."""
        assert parked.channel is not None and parked.pid is not None
        try:
            send(parked.channel, {"adopt": request}, fds)
        except OSError:
            return False
        for fd in fds:
            os.close(fd)
        # The old client, if it still waits, hears the connection close and ends as its rank would have, of SIGKILL:
        # its step is over.
        self._forget(parked)
        for key in [k for k, r in self.ranks.items() if r is parked]:
            del self.ranks[key]
        was = parked.attempt
        parked.conn, parked.client, parked.what, parked.attempt = (
            rank.conn,
            rank.client,
            rank.what,
            rank.attempt,
        )
        parked.may_stay, parked.parked_at, parked.orphaned_at = False, None, None
        self.ranks[rank.conn.fileno()] = parked
        self.say(
            f"hpkit: warm start on {self.node}: {parked.what} (attempt {parked.attempt}) adopted process "
            f"{parked.pid}, which stayed from attempt {was}, for process {parked.client}"
        )
        try:
            send(parked.conn, {"pid": parked.pid})
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(parked.pid, signal.SIGKILL)
        return True

    def _end_leaving(self, argv: list[str]) -> None:
        """Kill the ranks of `argv` still leaving an ended step (not parked): a new process of the same command now
        starts on this node, and both would hold its memory (a GPU's) at once."""
        for rank in self.ranks.values():
            if self._staying(rank) and rank.parked_at is None and rank.argv == argv and rank.pid is not None:
                self.say(
                    f"hpkit: warm: {rank.what} on {self.node} (process {rank.pid}, attempt {rank.attempt}) had not "
                    "left its step when the next step's rank started here: killed"
                )
                with contextlib.suppress(OSError):
                    os.kill(rank.pid, signal.SIGKILL)
                rank.orphaned_at = None  # reaped next

    def _heard(self, channel: socket.socket) -> None:
        """A rank's word on its channel: it may stay, or it has parked."""
        rank = self.channels.get(channel.fileno())
        try:
            message, _ = receive(channel)
        except (OSError, ValueError):
            message = None
        if rank is None or message is None:  # the rank has ended (reaped next) or closed its end
            self._close_channel(channel)
            return
        if message.get("may_stay"):
            rank.may_stay = True
        if message.get("parked"):
            rank.parked_at = time.monotonic()
            if (
                rank.conn.fileno() >= 0
            ):  # its client still stands for it: it ends, and its launcher's step with it
                with contextlib.suppress(OSError):
                    send(rank.conn, {"exit": STAYED_EXIT})

    def _close_channel(self, channel: socket.socket) -> None:
        rank = self.channels.pop(channel.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(channel)
        channel.close()
        if rank is not None:
            rank.channel = None

    def _timeout(self) -> float | None:
        """How long the loop may wait: a second while a rank waits to park or is parked (_expire), else no limit."""
        return 1.0 if any(self._staying(r) for r in self.ranks.values()) else None

    @staticmethod
    def _staying(rank: _Rank) -> bool:
        """Whether a rank outlives its client: it has parked, or may still (its client gone)."""
        return (
            rank.orphaned_at is not None
            and rank.pid is not None
            and (rank.may_stay or rank.parked_at is not None)
        )

    def _expire(self) -> None:
        """Kill a rank whose client went PARK_WINDOW_S ago and that has not parked, and a parked one that no step
        has adopted within PARK_S."""
        now = time.monotonic()
        for rank in list(self.ranks.values()):
            if not self._staying(rank) or rank.pid is None or rank.orphaned_at is None:
                continue
            if rank.parked_at is None and now - rank.orphaned_at >= self.park_window_s:
                why = (
                    f"had not left its step {self.park_window_s:.0f} s after the step ended (blocked in a collective "
                    "that cannot be interrupted): killed; the next step starts a new process in its place"
                )
            elif rank.parked_at is not None and now - max(rank.parked_at, rank.orphaned_at) >= self.park_s:
                why = f"stayed for the next step, and none took it over within {self.park_s:.0f} s: ended"
            else:
                continue
            self.say(
                f"hpkit: warm: {rank.what} on {self.node} (process {rank.pid}, attempt {rank.attempt}) {why}"
            )
            with contextlib.suppress(OSError):
                os.kill(rank.pid, signal.SIGKILL)
            rank.orphaned_at = None  # reaped next

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for key, rank in list(self.ranks.items()):
                if rank.pid == pid:
                    ended = (
                        {"signal": os.WTERMSIG(status)}
                        if os.WIFSIGNALED(status)
                        else {"exit": os.waitstatus_to_exitcode(status)}
                    )
                    if rank.conn.fileno() >= 0:
                        with contextlib.suppress(OSError):
                            send(rank.conn, ended)
                    elif self._staying(rank) and rank.parked_at is None and rank.orphaned_at is not None:
                        how = f"signal {ended['signal']}" if "signal" in ended else f"exit {ended['exit']}"
                        self.say(
                            f"hpkit: warm: {rank.what} on {self.node} (process {pid}, attempt {rank.attempt}) ended "
                            f"({how}) after its step did, before it had parked: the next step starts a new process in "
                            "its place"
                        )
                    rank.pid = None
                    if rank.channel is not None:
                        self._close_channel(rank.channel)
                    self._forget(rank)
                    self.ranks.pop(key, None)

    def _forget(self, rank: _Rank, keep_pid: bool = False) -> None:
        """Stop listening to a rank's client; a rank still running is kept until reaped."""
        if rank.conn.fileno() >= 0:
            fd = rank.conn.fileno()
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(rank.conn)
            rank.conn.close()
            if rank.pid is None or not keep_pid:
                self.ranks.pop(fd, None)
            else:  # re-keyed: the descriptor number may be reused by the next client
                self.ranks.pop(fd, None)
                self.ranks[-rank.pid] = rank

    # -- the forked rank ------------------------------------------------------------------------------------

    def _child(self, zygote: int, rank: _Rank, request: dict[str, Any], fds: list[int], go: int) -> NoReturn:
        try:
            _die_with(zygote)
            signal.set_wakeup_fd(-1)
            self.selector.close()
            for other in self.ranks.values():
                if other.conn.fileno() >= 0:
                    other.conn.close()
                if other.channel is not None:
                    other.channel.close()
            for fd in self._own_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            os.setsid()
            become(request, fds)
            target = python_target([str(a) for a in request["argv"]], sys.executable)
            assert target is not None
            if os.read(go, 2) != b"go":  # the client never heard of this process: it runs the command cold
                os._exit(128 + signal.SIGKILL)
            os.close(go)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(run_as_main(target))


def remove_leftovers(folder: Path) -> None:
    """Remove the sockets of zygotes that have gone without removing theirs (a job's end kills them): nothing
    answers on them any more."""
    for path in folder.glob("*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            probe.close()


def run_as_main(target: list[str]) -> int:
    """Run `-m MODULE ARGS` or `SCRIPT ARGS` as `python` runs it, in a fresh `__main__`, and end as it ends:
    its exit status (SystemExit, an uncaught exception), after its threads and atexit functions, as at exit."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    interrupted, code = False, 0
    try:
        if target[0] == "-m":
            sys.argv = list(target[1:])  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            # Run as `python -m` runs it: as __main__, apart from its importable copy, which the preload may have
            # made (runpy would warn that it is already in sys.modules). What it imports stays imported.
            sys.modules.pop(target[1], None)
            runpy._run_module_as_main(target[1], alter_argv=True)  # type: ignore[attr-defined]
        else:
            script = target[0]
            sys.argv = list(target)
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            main.__dict__.update(__file__=script, __cached__=None, __spec__=None, __loader__=None)
            with open(script, "rb") as source:
                code_object = compile(source.read(), script, "exec")
            exec(code_object, main.__dict__)
    except SystemExit as exc:
        code = _exit_status(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted, code = True, 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    code = _finish(code)
    if interrupted:  # as python does since 3.8: die of the SIGINT, so the caller sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _finish(code: int) -> int:
    threading._shutdown()  # type: ignore[attr-defined]  (non-daemon threads, as at exit)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = code or 120  # python's status when flushing stdout fails at exit
    return code


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _die_with(zygote: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != zygote:  # the zygote died before the line above
        os._exit(128 + signal.SIGKILL)


def preload(modules: list[str], say: Callable[[str], None]) -> list[str]:
    """Import each module; the ones that failed (one line each: the rank imports them itself, cold)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            say(f"hpkit: warm: cannot preload {name}: {type(exc).__name__}: {exc}")
            failed.append(name)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpkit.warm.zygote")
    parser.add_argument("--preload", default="", help="modules to import before serving, comma-separated")
    parser.add_argument(
        "--preload-more",
        default="",
        help="the job's own modules to import after those (resilience.warm_preload), comma-separated",
    )
    parser.add_argument(
        "--park-window-s",
        type=float,
        default=PARK_WINDOW_S,
        help="how long a rank that may stay has to park after its client went",
    )
    parser.add_argument(
        "--park-s", type=float, default=PARK_S, help="how long a parked rank waits for a step to adopt it"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    path = socket_path(os.environ)
    if path is None:
        print(
            f"hpkit: warm: not in a Slurm job step (SLURM_JOB_ID, SLURMD_NODENAME) and no {SOCKET_ENV}: not serving",
            file=sys.stderr,
        )
        return 2
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()

    def say(text: str) -> None:
        print(text, flush=True)

    began = time.monotonic()
    preload([m for m in args.preload.split(",") if m], say)
    left = native_threads()
    more = [m for m in args.preload_more.split(",") if m]
    preload(more, say)
    if native_threads() > left:
        # A fork copies only the forking thread: a thread of the job's own modules (a pool, a watcher) would be
        # missing in every rank, and any lock it held at the fork held forever. hpkit's own imports are known.
        say(
            f"hpkit: warm: preloading {','.join(more)} left {native_threads() - left} more thread(s) running, which a "
            "fork would not copy: ranks start cold; take the module that starts them out of resilience.warm_preload"
        )
    zygote = Zygote(path, say, node, threads=left, park_window_s=args.park_window_s, park_s=args.park_s)
    preloaded = ",".join(m for m in (args.preload, args.preload_more) if m)
    zygote.serve(ready_line(node, time.monotonic() - began, preloaded, zygote.threads))
    return 0


if __name__ == "__main__":
    # The module's own globals, not __main__'s: a forked rank gets a fresh __main__.
    from hpkit.warm import zygote as _module

    sys.exit(_module.main())
