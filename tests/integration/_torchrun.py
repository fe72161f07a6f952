"""Starting real multi-process torch runs from tests: torchrun with a private TMPDIR and one thread each.

Launches start warm: every torchrun agent and every rank is forked by one zygote per test process (hpkit.warm,
the product's own warm start, served here outside Slurm on a socket named by HPKIT_WARM_SOCKET) that imported torch
and hpkit's runtime once. The suite is CPU-bound on its 2-core machine, and a cold rank spends about 3 CPU-s on its
interpreter and imports before it does anything a test checks; a forked one, none. Each process still gets the
command's own argv, environment, folder, TMPDIR and stdio, and the client it runs behind exits as it does. A
launch the zygote cannot start warm (a start-up variable such as OMP_NUM_THREADS differs: extra_env) runs cold, as
does everything with HPKIT_TEST_COLD=1. Tests that read a rank's /proc cmdline, or that need a rank in another
namespace (run_two_agents), start cold.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

from hpkit.rendezvous import free_local_ports
from hpkit.warm.protocol import SOCKET_ENV
from hpkit.warm.protocol import startup_env as product_startup_env

REPO = Path(__file__).resolve().parents[2]
COLD_ENV = "HPKIT_TEST_COLD"
# What a rank of these tests imports before its first line of work: the agent's modules and hpkit train's.
PRELOAD = (
    "torch,torch._dynamo,torch.distributed.run,hpkit.run_script,hpkit.cli,hpkit.commands.train,hpkit.runtime.run,"
    "hpkit.runtime.loop.trainer"
)
ZYGOTE_READY_S = 180
# A zygote's line for each process it forks (hpkit.warm.zygote): the forked process's pid, then its client's.
FORKED = re.compile(r"forked as process (\d+) for process (\d+)")
# The one thread that starts zygotes, alive as long as this process. A zygote dies with the thread that started it
# (PR_SET_PDEATHSIG follows the parent thread, not the process): one started by run_together's pool was SIGKILLed
# when the pool ended, and every later launch with its start-up variables ran cold for the rest of the session.
_STARTER = ThreadPoolExecutor(1, thread_name_prefix="zygote-starter")


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """What a zygote of these tests must start with: hpkit.warm.protocol's start-up variables and libfaketime's
    (the hang drills' skewed node preloads it; it reads FAKETIME as the process starts, so a rank forked from a
    zygote started without it would find its clock jumping later, not set from its start)."""
    return product_startup_env(env) | {k: v for k, v in env.items() if k.startswith("FAKETIME")}


def torch_env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    python_path = [str(REPO / "python"), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env.update(
        # Each folder once (dict: first place kept): the session cluster puts REPO/python on this process's
        # PYTHONPATH, and a launch before it came up must not need another zygote than one after.
        PYTHONPATH=os.pathsep.join(p for p in dict.fromkeys(python_path) if p),
        # torchrun leaves a torchelastic_* folder per run in TMPDIR; keep each test's to itself.
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPKIT_SPEC"):
        env.pop(var, None)
    return env


class _Zygote:
    """A zygote of this test process, started at the first warm launch with its start-up variables and ended with
    the process. One per set of start-up variables (hpkit.warm.protocol.startup_env: a zygote refuses a launch
    whose PYTHONPATH or OMP_NUM_THREADS differ from its own): a session cluster sets PYTHONPATH when it comes up,
    and some tests give their own. At most MAX_ZYGOTES (each holds torch in memory); beyond, launches start cold."""

    MAX_ZYGOTES = 3
    lock = threading.Lock()
    running: ClassVar[dict[tuple, _Zygote | None]] = {}
    # client pid -> (the pid forked for it, when its line was read), from every zygote's lines.
    forked: ClassVar[dict[int, tuple[int, float]]] = {}

    def __init__(self, proc: subprocess.Popen[str], folder: Path):
        self.proc, self.folder = proc, folder

    @classmethod
    def socket(cls, env: dict[str, str]) -> Path | None:
        """The socket of the zygote for `env`'s start-up variables, starting it first if need be; None: the launch
        starts cold (HPKIT_TEST_COLD, too many zygotes, or this one did not come up or died: said on stderr)."""
        if os.environ.get(COLD_ENV) == "1":
            return None
        key = cls.key(env)
        with cls.lock:
            if key not in cls.running:
                if len(cls.running) >= cls.MAX_ZYGOTES:
                    return None
                cls.running[key] = _STARTER.submit(cls._start, env).result()
            zygote = cls.running[key]
            if zygote is None or zygote.proc.poll() is not None:
                return None
            return zygote.folder / "z.sock"

    @staticmethod
    def key(env: dict[str, str]) -> tuple:
        """Which zygote serves `env`: one per set of start-up variables."""
        return tuple(sorted(startup_env(env).items()))

    @classmethod
    def _start(cls, launch_env: dict[str, str]) -> _Zygote | None:
        # In node memory and short: a Unix socket's path holds at most 107 characters, and TMPDIR is deep here.
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
        folder = Path(tempfile.mkdtemp(prefix="hpkit-tz-", dir=base))
        path = folder / "z.sock"
        (folder / "tmp").mkdir()
        # This process's environment with the launch's start-up variables: nothing else of one launch's own.
        own = startup_env(os.environ)
        env = {k: v for k, v in os.environ.items() if k not in own}
        env |= startup_env(launch_env) | {"TMPDIR": str(folder / "tmp"), SOCKET_ENV: str(path)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpkit.warm.zygote", f"--preload={PRELOAD}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            preexec_fn=_die_with_parent,
        )
        zygote = cls(proc, folder)
        atexit.register(zygote.stop)
        assert proc.stdout is not None
        ready = ""
        if select.select([proc.stdout], [], [], ZYGOTE_READY_S)[0]:
            ready = proc.stdout.readline()
        if "ready" not in ready:
            print(
                f"_torchrun: a zygote did not come up ({ready.strip()!r}): its launches start cold",
                file=sys.stderr,
            )
            zygote.stop()
            return None
        # Its later lines (a line per process forked) are read off, so its pipe never fills.
        threading.Thread(target=cls._read_forks, args=(proc.stdout,), daemon=True).start()
        return zygote

    @classmethod
    def _read_forks(cls, stream) -> None:
        for line in stream:
            if found := FORKED.search(line):
                cls.forked[int(found.group(2))] = (int(found.group(1)), time.monotonic())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _die_with_parent() -> None:
    """The zygote dies with the test process that started it, even when that one is SIGKILLed."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def warm(cmd: list[str], env: dict[str, str]) -> list[str]:
    """`cmd` (a `sys.executable ...` command) started by this process's zygote: the warm client's words before it,
    and its socket in `env`; `cmd` unchanged where launches start cold."""
    path = _Zygote.socket(env)
    if path is None:
        return cmd
    env[SOCKET_ENV] = str(path)
    return [sys.executable, "-m", "hpkit.warm.client", "--", *cmd]


def rank_pid(client: subprocess.Popen, since: float, timeout: float = 60) -> int:
    """The pid of the process a launch through `warm` runs: the one its node's zygote forked for `client`, or the
    client's own where it started cold (it exec'ed the command). `since`: the monotonic time before `client` was
    started, so that a line about an earlier process with the same pid is not taken for it."""
    deadline = time.monotonic() + timeout
    own = Path("/proc/self/cmdline").read_bytes()
    while True:
        found = _Zygote.forked.get(client.pid)
        if found is not None and found[1] >= since:
            return found[0]
        try:
            cmdline = Path(f"/proc/{client.pid}/cmdline").read_bytes()
        except OSError:
            return client.pid  # gone before a fork
        # Empty, or this process's own: still inside its exec (Popen can return while the child is mid-execve: its
        # name was still pytest's, its cmdline empty), neither client nor command yet.
        execed = cmdline not in (b"", own)
        if (execed and b"hpkit.warm.client" not in cmdline) or client.poll() is not None:
            return client.pid  # cold (exec'ed the command), or gone before a fork
        if time.monotonic() > deadline:
            raise AssertionError(f"no zygote forked a process for client {client.pid} in {timeout:.0f} s")
        time.sleep(0.01)


def sigkill(pids: list[int]) -> None:
    """SIGKILL each process back to back (rank_pid's: a warm client dies of it after its rank); one already gone
    is passed over."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def torchrun_command(args: list[str], nproc: int, env: dict[str, str], *options: str) -> list[str]:
    """`torchrun --nproc-per-node NPROC OPTIONS ARGS` with its agent and each rank forked warm where `env` can
    be (see warm; `env` gets the socket); ARGS as torchrun takes them: a script or `-m MODULE`, then its args."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *options]
    if _Zygote.socket(env) is None:
        return [*agent, *args]
    # torchrun runs `python -u ARGS` (interpreter options start cold); --no-python runs the words given instead.
    rank = warm([sys.executable, *args], env)
    return warm([*agent, "--no-python", "--", *rank], env)


def run(
    args: list[str],
    tmp: Path,
    nproc: int | None,
    timeout: float = 400,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python ARGS` (nproc None) or `torchrun --nproc-per-node N ARGS`, with `extra_env` added to its
    environment; fail with its output."""
    env = torch_env(tmp) | (extra_env or {})
    if nproc is None:
        cmd = warm([sys.executable, *args], env)
    else:
        # --standalone: a free port per launch, so concurrent test runs on this host do not collide.
        cmd = torchrun_command(args, nproc, env, "--standalone")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited with {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n"
            f"--- stderr\n{done.stderr[-10000:]}"
        )
    return done


def run_together(launches: dict[Any, tuple], timeout: float = 400) -> dict[Any, subprocess.CompletedProcess]:
    """`run` for each named (args, tmp, nproc[, extra_env]) at once: independent launches of one fixture
    overlap their interpreter and torch start-up, rendezvous and shutdown instead of waiting on each other.
    Each needs its own tmp; a failure is raised once every launch has ended."""
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {k: pool.submit(run, *launch[:3], timeout, *launch[3:]) for k, launch in launches.items()}
        return {k: f.result() for k, f in futures.items()}


def run_two_agents(
    args: list[str], tmp: Path, nproc: int, second_node_hides: Path, timeout: float = 400
) -> subprocess.CompletedProcess:
    """Two torchrun agents on this host, as two nodes of `nproc` ranks each; the second runs in its own
    mount namespace where `second_node_hides` reads as an empty file (root only: unshare -m)."""
    port = free_local_ports()

    def agent(node_rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=hpkit-test-{port}",
            *args,
        ]

    hide = f'mount --bind /dev/null {shlex.quote(str(second_node_hides))} && exec "$@"'
    second = ["unshare", "-m", "--propagation", "private", "sh", "-c", hide, "sh", *agent(1)]
    env = torch_env(tmp)
    first_proc = subprocess.Popen(
        agent(0), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    second_proc = subprocess.Popen(
        second, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        out1, err1 = first_proc.communicate(timeout=timeout)
        out2, err2 = second_proc.communicate(timeout=timeout)
    finally:
        for p in (first_proc, second_proc):
            if p.poll() is None:
                p.kill()
    if first_proc.returncode or second_proc.returncode:
        raise AssertionError(
            f"two-agent run exited with {first_proc.returncode}/{second_proc.returncode}\n--- node 1 stdout\n"
            f"{out1[-4000:]}\n--- node 1 stderr\n{err1[-6000:]}\n--- node 2 stderr\n{err2[-6000:]}"
        )
    return subprocess.CompletedProcess(agent(0), 0, out1 + out2, err1 + err2)
