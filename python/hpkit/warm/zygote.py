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
  was killed, its step cancelled): no rank outlives its step;
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
import io
import os
import random
import runpy
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hpkit.warm.protocol import (
    SOCKET_ENV,
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


@dataclass
class _Rank:
    conn: socket.socket
    client: int  # the client's pid: the process the launcher started, and names in its reports
    pid: int | None = None


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
    def __init__(self, path: Path, say: Callable[[str], None], node: str = "", threads: int | None = None):
        self.path, self.say, self.node = path, say, node
        self.env = dict(os.environ)  # what this interpreter started with (protocol.STARTUP_VARS)
        # What the preload left: forks may not find more (main: what hpkit's own preload left, so that threads a
        # user's warm_preload started refuse every fork).
        self.threads = native_threads() if threads is None else threads
        self.ranks: dict[int, _Rank] = {}  # by the connection's descriptor
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
                for key, _ in self.selector.select():
                    if key.data == "listen":
                        self._accept(listener)
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            while os.read(wake_r, 512):
                                pass
                    else:
                        self._handle(key.fileobj)  # type: ignore[arg-type]
                self._reap()
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
            # The client is gone (killed, its step cancelled): so is its rank.
            if rank.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(rank.pid, signal.SIGKILL)
            self._forget(rank, keep_pid=True)
            return
        if rank.pid is None and "argv" in message:
            self._start(rank, message, fds)
        elif "signal" in message and rank.pid is not None:
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
        sys.stdout.flush()
        sys.stderr.flush()
        zygote = os.getpid()
        # The rank waits for this pipe before it runs anything of the command: once the client has its pid. A
        # zygote that dies in between leaves the client without an answer, and it starts the command cold: the
        # command must not have begun here too.
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            self._child(zygote, rank, request, fds, go_read)
        os.close(go_read)
        for fd in fds:
            os.close(fd)
        rank.pid = pid
        self.started += 1
        env = request.get("env") or {}
        target = python_target([str(a) for a in request["argv"]], sys.executable) or ["?"]
        # A rank by its number; anything else (torchrun's agent) by its module or script.
        what = f"rank {env['RANK']}" if "RANK" in env else target[1] if target[0] == "-m" else target[0]
        # torchrun's reports name the process it started, the client: the line maps it to the rank's own.
        self.say(
            f"hpkit: warm start on {self.node}: {what} (attempt {env.get('HPKIT_STEP_ATTEMPT', '?')}) forked as "
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
                    if rank.conn.fileno() >= 0:
                        ended = (
                            {"signal": os.WTERMSIG(status)}
                            if os.WIFSIGNALED(status)
                            else {"exit": os.waitstatus_to_exitcode(status)}
                        )
                        with contextlib.suppress(OSError):
                            send(rank.conn, ended)
                    rank.pid = None
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
            for fd in self._own_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            os.setsid()
            if (cpus := request.get("cpus")) is not None:
                os.sched_setaffinity(0, cpus)
            _signals(request.get("ignored_signals") or [])
            os.umask(int(request.get("umask", 0o022)))
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
            # tempfile keeps the folder it found first (torch's import asks): the rank's TMPDIR decides again.
            tempfile.tempdir = None
            os.chdir(request.get("cwd") or "/")
            _descriptors(request.get("fds") or [], fds)
            _streams(os.environ)
            random.seed()
            if (numpy := sys.modules.get("numpy")) is not None:
                numpy.random.seed()
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


def _signals(ignored: list[int]) -> None:
    """The dispositions python starts with, and what the client's parent had ignored ignored still."""
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(ValueError):
            signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in ignored:
        with contextlib.suppress(ValueError):
            signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _descriptors(targets: list[int], fds: list[int]) -> None:
    for target, fd in zip(targets, fds, strict=True):
        os.dup2(fd, target)
        if fd != target:
            os.close(fd)
    for target in (0, 1, 2):
        if target not in targets:
            with contextlib.suppress(OSError):
                os.close(target)


def _streams(env: dict[str, str] | os._Environ[str]) -> None:
    """sys.stdin, stdout and stderr anew on the rank's descriptors: a terminal or a pipe decides their buffering,
    and PYTHONUNBUFFERED, as at an interpreter's start."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"

    def stream(fd: int, write: bool, errors: str) -> io.TextIOWrapper | None:
        try:
            os.fstat(fd)
        except OSError:
            return None
        raw = io.FileIO(fd, "w" if write else "r", closefd=False)
        buffered: Any = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
        tty = raw.isatty()
        return io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors=errors,
            line_buffering=write and (tty or fd == 2),
            write_through=write and unbuffered,
        )

    sys.stdin = sys.__stdin__ = stream(0, False, "strict")  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = stream(1, True, "strict")  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace")  # type: ignore[misc]


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
    zygote = Zygote(path, say, node, threads=left)
    preloaded = ",".join(m for m in (args.preload, args.preload_more) if m)
    zygote.serve(ready_line(node, time.monotonic() - began, preloaded, zygote.threads))
    return 0


if __name__ == "__main__":
    # The module's own globals, not __main__'s: a forked rank gets a fresh __main__.
    from hpkit.warm import zygote as _module

    sys.exit(_module.main())
