"""Warm starts (hpkit.warm): a real zygote process and real clients, the way torchrun's agent starts them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpkit.errors import HpkitError, SpecError
from hpkit.render import render
from hpkit.slurm.job import oci_warm_problem
from hpkit.spec import JobSpec
from hpkit.validation import parse_document
from hpkit.warm import protocol
from hpkit.warm.zygote import can_bind, remove_leftovers

PY = sys.executable
# A rank that reports who it is and what it was given, then does what its first argument says.
RANK = r"""
import os, signal, sys
what = sys.argv[1]
print("rank", os.getpid(), os.getppid(), os.getcwd(), os.environ.get("WHO"), sys.argv[1:], flush=True)
print("to stderr", file=sys.stderr, flush=True)
if what == "read":
    print("read", sys.stdin.readline().strip(), flush=True)
elif what == "usr1":
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))
    print("ready", flush=True)
    signal.pause()
elif what == "wait":
    print("ready", flush=True)
    signal.pause()
elif what == "cpus":
    print("cpus", sorted(os.sched_getaffinity(0)), flush=True)
elif what == "raise":
    raise ValueError("boom")
sys.exit(int(what) if what.isdigit() else 0)
"""


@contextlib.contextmanager
def short_folder() -> Iterator[Path]:
    """A folder with a short path: a Unix socket's path holds at most 107 characters, and pytest's folders under
    xdist and make test's TMPDIR (/tmp/hpkit-test/pytest-of-root/pytest-0/popen-gw2/test_zygote_gone_ends_c0/...)
    left too few for the socket's own name: the bind failed, and the zygote's client ran its rank cold. In node
    memory, as the zygote's own default; never under TMPDIR, whose depth is the caller's."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    folder = Path(tempfile.mkdtemp(prefix="hpkit-warm-test-", dir=base))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """pytest's tmp_path, short (short_folder)."""
    with short_folder() as folder:
        yield folder


def job_env(root: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPKIT_", "SLURM"))}
    return {**env, protocol.ROOT_ENV: str(root), "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "node-a", **more}


@pytest.fixture(scope="module")
def zygote() -> Iterator[tuple[subprocess.Popen[str], Path]]:
    with short_folder() as root:
        yield from _zygote(root)


def _zygote(root: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    proc = subprocess.Popen(
        [PY, "-m", "hpkit.warm.zygote", "--preload", "json,hpkit.run_script"],
        env=job_env(root),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()  # its ready line: the socket is bound before it is written
    assert "ready" in ready, ready
    # The rest of its lines (one per rank started) are read off, so its pipe never fills.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield proc, root
    proc.terminate()
    assert proc.wait(timeout=60) == 0


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def client(root: Path, argv: list[str], **kw) -> subprocess.Popen[str]:
    env = job_env(root, **{"WHO": "me", **kw.pop("env", {})})
    return subprocess.Popen(
        [PY, "-m", "hpkit.warm.client", "--", *argv],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def rank_line(proc: subprocess.Popen[str]) -> tuple[int, int]:
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[:1] == ["rank"], words
    return int(words[1]), int(words[2])


def wait_gone(pid: int) -> None:
    """Returns once `pid` (not our child) has ended; fails the test if it is still there after a minute."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 60)[0], f"process {pid} still runs"
    finally:
        os.close(fd)


def test_rank_is_forked_with_the_clients_argv_env_cwd_and_stdio(zygote, script, tmp_path: Path) -> None:
    proc, root = zygote
    rank = client(root, [PY, str(script), "read", "x y"], cwd=tmp_path)
    out, err = rank.communicate("hello\n", timeout=120)
    lines = out.splitlines()
    words = lines[0].split()
    assert int(words[2]) == proc.pid  # forked by the zygote, not exec'ed by the client
    assert words[3:5] == [str(tmp_path), "me"]
    assert lines[0].endswith("['read', 'x y']")
    assert lines[1] == "read hello"
    assert "to stderr" in err and "refused" not in err
    assert rank.returncode == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to fewer CPUs needs two")
def test_rank_runs_on_its_clients_cpus_not_the_zygotes(zygote, script) -> None:
    """Slurm's task/affinity binds the rank's task to its CPUs; the zygote's step is bound apart. A cold rank keeps its
    task's CPUs, and so must a warm one: else every rank of a node would share the zygote's one CPU."""
    proc, root = zygote
    one = {max(os.sched_getaffinity(proc.pid))}
    rank = client(root, [PY, str(script), "cpus"], preexec_fn=lambda: os.sched_setaffinity(0, one))
    out, err = rank.communicate(timeout=120)
    assert "refused" not in err and rank.returncode == 0, err
    assert int(out.splitlines()[0].split()[2]) == proc.pid  # forked, not cold
    assert out.splitlines()[-1] == f"cpus {sorted(one)}"
    assert os.sched_getaffinity(proc.pid) != one  # the zygote's own binding is as it was


def test_cpus_outside_the_zygotes_reach_refuse_the_fork_and_leave_its_binding() -> None:
    mine = os.sched_getaffinity(0)
    assert can_bind(mine)
    assert not can_bind({*mine, os.cpu_count() or 1})  # a CPU no cgroup of this machine holds
    assert os.sched_getaffinity(0) == mine


def test_exit_status_and_uncaught_exception_are_the_ranks(zygote, script) -> None:
    _, root = zygote
    rank = client(root, [PY, str(script), "7"])
    rank.communicate(timeout=120)
    assert rank.returncode == 7
    rank = client(root, [PY, str(script), "raise"])
    _, err = rank.communicate(timeout=120)
    assert rank.returncode == 1
    assert "ValueError: boom" in err


def test_module_runs_as_python_m(zygote, tmp_path: Path) -> None:
    _, root = zygote
    (tmp_path / "mymod.py").write_text(
        "import os, sys\nprint(__name__, os.getppid(), sys.argv[0].endswith('mymod.py'), sys.argv[1:])\n"
    )
    rank = client(root, [PY, "-m", "mymod", "a"], cwd=tmp_path)
    out, err = rank.communicate(timeout=120)
    assert out.split() == ["__main__", str(zygote[0].pid), "True", "['a']"], err


def test_socket_named_outright_serves_outside_slurm_and_rank_gets_its_own_tmpdir(tmp_path: Path) -> None:
    """HPKIT_WARM_SOCKET: a zygote and its clients outside any Slurm job. The zygote's preload asked tempfile for
    its folder (torch's import does): the rank's TMPDIR still decides the rank's, as in a cold start."""
    (tmp_path / "asks_tmp.py").write_text("import tempfile\nASKED = tempfile.gettempdir()\n")
    zygote_tmp, rank_tmp = tmp_path / "z", tmp_path / "r"
    zygote_tmp.mkdir()
    rank_tmp.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HPKIT_", "SLURM"))}
    env = {**base, "PYTHONPATH": str(tmp_path), protocol.SOCKET_ENV: str(tmp_path / "own" / "z.sock")}
    proc = subprocess.Popen(
        [PY, "-m", "hpkit.warm.zygote", "--preload", "asks_tmp"],
        env={**env, "TMPDIR": str(zygote_tmp)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "ready" in proc.stdout.readline()
        (tmp_path / "report.py").write_text(
            "import os, tempfile, asks_tmp\nprint(os.getppid(), asks_tmp.ASKED, tempfile.gettempdir())\n"
        )
        rank = subprocess.run(
            [PY, "-m", "hpkit.warm.client", "--", PY, "-m", "report"],
            env={**env, "TMPDIR": str(rank_tmp)},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert rank.returncode == 0, rank.stderr
        assert rank.stdout.split() == [str(proc.pid), str(zygote_tmp), str(rank_tmp)], rank.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_signal_reaches_the_rank_and_its_handler_decides(zygote, script) -> None:
    _, root = zygote
    rank = client(root, [PY, str(script), "usr1"])
    rank_line(rank)
    assert rank.stdout.readline().strip() == "ready"
    rank.send_signal(signal.SIGUSR1)
    rank.communicate(timeout=120)
    assert rank.returncode == 3


def test_client_dies_of_the_signal_that_killed_the_rank(zygote, script) -> None:
    _, root = zygote
    rank = client(root, [PY, str(script), "wait"])
    rank_line(rank)
    assert rank.stdout.readline().strip() == "ready"
    rank.send_signal(signal.SIGTERM)  # the rank's default action: it dies of it, and the client alike
    rank.communicate(timeout=120)
    assert rank.returncode == -signal.SIGTERM


def test_client_killed_kills_its_rank(zygote, script) -> None:
    _, root = zygote
    rank = client(root, [PY, str(script), "wait"])
    pid, parent = rank_line(rank)
    assert parent == zygote[0].pid
    rank.kill()
    rank.wait(timeout=60)
    wait_gone(pid)


def test_no_zygote_runs_the_command_cold(script, tmp_path: Path) -> None:
    rank = client(tmp_path / "nothing-here", [PY, str(script), "5"])
    pid, _ = rank_line(rank)
    _, err = rank.communicate(timeout=120)
    assert pid == rank.pid  # exec'ed in the client's place
    assert rank.returncode == 5
    assert "refused" not in err


def test_start_up_variable_that_differs_starts_cold_with_one_line(zygote, script) -> None:
    _, root = zygote
    rank = client(root, [PY, str(script), "0"], env={"PYTHONPATH": "/elsewhere"})
    pid, _ = rank_line(rank)
    _, err = rank.communicate(timeout=120)
    assert pid == rank.pid
    assert "warm start refused (PYTHONPATH differ(s) from the zygote's): starting cold" in err


def test_another_interpreter_starts_cold(zygote) -> None:
    _, root = zygote
    rank = client(root, ["sh", "-c", "echo rank $$ 0"])
    pid, _ = rank_line(rank)
    _, err = rank.communicate(timeout=120)
    assert pid == rank.pid
    assert "is not" in err


def test_zygote_gone_ends_client_and_rank(tmp_path: Path, script) -> None:
    zyg = subprocess.Popen(
        [PY, "-m", "hpkit.warm.zygote"], env=job_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    assert "ready" in zyg.stdout.readline()
    threading.Thread(target=zyg.stdout.read, daemon=True).start()
    rank = client(tmp_path, [PY, str(script), "wait"])
    pid, parent = rank_line(rank)
    assert parent == zyg.pid
    zyg.kill()
    zyg.wait(timeout=60)
    _, err = rank.communicate(timeout=120)
    assert rank.returncode == -signal.SIGKILL, err
    wait_gone(pid)


def test_zygote_with_a_thread_refuses_to_fork(tmp_path: Path) -> None:
    # In a process of its own: pytest's may run threads of its own.
    check = f"""
import os, sys, threading
from pathlib import Path
from hpkit.warm.zygote import Zygote
zygote = Zygote(Path({str(tmp_path)!r}) / "z.sock", say=print)
request = {{"argv": [sys.executable, "x.py"], "env": dict(os.environ)}}
print(zygote.refusal(request))
stop = threading.Event()
threading.Thread(target=stop.wait).start()
print(zygote.refusal(request))
stop.set()
"""
    done = subprocess.run([PY, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["None", "the zygote runs 2 Python threads"], done.stderr


def test_python_target() -> None:
    assert protocol.python_target([PY, "-m", "hpkit", "train"], PY) == ["-m", "hpkit", "train"]
    assert protocol.python_target([PY, "s.py", "-x"], PY) == ["s.py", "-x"]
    assert protocol.python_target([PY, "-u", "s.py"], PY) is None
    assert protocol.python_target([PY, "-m"], PY) is None
    assert protocol.python_target(["/usr/bin/env", "s.py"], PY) is None


def test_socket_path_is_per_job_and_node() -> None:
    a = protocol.socket_path({"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "n1", protocol.ROOT_ENV: "/r"})
    b = protocol.socket_path({"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "n2", protocol.ROOT_ENV: "/r"})
    assert a != b and a is not None and a.parent == Path(f"/r/hpkit-warm-{os.getuid()}")
    assert protocol.socket_path({"SLURM_JOB_ID": "1"}) is None


def test_a_dead_zygotes_socket_is_removed_by_the_next(tmp_path: Path) -> None:
    folder = tmp_path / f"hpkit-warm-{os.getuid()}"
    folder.mkdir(mode=0o700)
    dead = folder / "1-node-z.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(dead))
    sock.close()  # bound, never listening: a zygote that was SIGKILLed
    remove_leftovers(folder)
    assert not dead.exists()


def test_launcher_gone_ends_client_and_rank(zygote, script, tmp_path: Path) -> None:
    """A client whose launcher dies (torchrun's agent, itself forked warm, SIGKILLed with its step) dies, and its
    rank with it: the launcher here is a shell that starts the client and says its pid."""
    _, root = zygote
    launcher = subprocess.Popen(
        ["sh", "-c", f'{PY} -m hpkit.warm.client -- {PY} {script} wait & echo "$!"; wait'],
        env=job_env(root, WHO="me"),
        stdout=subprocess.PIPE,
        text=True,
    )
    client_pid = int(launcher.stdout.readline())
    pid, parent = rank_line(launcher)
    assert parent == zygote[0].pid
    launcher.kill()
    launcher.wait(timeout=60)
    wait_gone(client_pid)
    wait_gone(pid)


def test_a_preloaded_module_runs_as_main_without_runpys_warning(zygote, script) -> None:
    # The zygote imported hpkit.run_script; `python -m hpkit.run_script` still runs it as __main__, quietly.
    _, root = zygote
    rank = client(root, [PY, "-m", "hpkit.run_script", str(script), "4"])
    out, err = rank.communicate(timeout=120)
    assert rank.returncode == 4
    assert out.split()[2] == str(zygote[0].pid)
    assert "RuntimeWarning" not in err, err


WARM_SPEC = {
    "name": "w",
    "nodes": 2,
    "launcher": "torchrun",
    "command": ["/opt/venv/bin/python", "-m", "hpkit", "train"],
    "resilience": {"spare_nodes": 1, "max_restarts": 2, "warm_start": True},
}


def test_warm_start_renders_the_client_before_agent_and_rank_and_the_zygote_in_the_plan() -> None:
    script = render(parse_document(JobSpec, WARM_SPEC))
    client_words = "/opt/venv/bin/python -m hpkit.warm.client -- /opt/venv/bin/python"
    assert f"--step '{client_words} -m hpkit.torchrun_agent --signals-to-handle=" in script
    assert f"--no-python -- {client_words} -m hpkit.run_script -m hpkit train'" in script
    assert '"warm": "/opt/venv/bin/python -m hpkit.warm.zygote' in script
    assert (
        "--preload=torch,torch._dynamo,torch.distributed.run,hpkit.torchrun_agent,hpkit.run_script,hpkit.cli,"
        in script
    )
    cold = render(parse_document(JobSpec, {**WARM_SPEC, "resilience": {"warm_start": False}}))
    assert "hpkit.warm" not in cold and '"warm"' not in cold


def test_under_srun_each_task_is_a_client_and_the_zygote_leaves_torchrun_out() -> None:
    script = render(parse_document(JobSpec, {**WARM_SPEC, "launcher": "srun"}))
    client_words = "/opt/venv/bin/python -m hpkit.warm.client -- /opt/venv/bin/python"
    assert f"hpkit-task {client_words} -m hpkit.run_script -m hpkit train" in script
    assert "hpkit.torchrun_agent" not in script
    assert (
        "--preload=torch,torch._dynamo,hpkit.run_script,hpkit.cli,hpkit.commands.train,hpkit.runtime.run"
        in script
    )


def test_a_compat_jobs_zygote_starts_with_the_shim_on_its_pythonpath_as_the_ranks_do() -> None:
    """The compat shim goes on each rank's PYTHONPATH, read as the interpreter starts: a zygote without it would
    refuse every rank (warm start refused: PYTHONPATH differs)."""
    script = render(parse_document(JobSpec, {**WARM_SPEC, "compat": ["smp_v2"]}))
    plan = json.loads(shlex.split(re.search(r"--plan ('.*?'|\S+) --step", script).group(1))[0])
    wrapper, _, zygote = plan["warm"].partition(" hpkit-task ")
    assert 'export PYTHONPATH="$shim' in shlex.split(wrapper)[2]
    assert zygote.startswith("/opt/venv/bin/python -m hpkit.warm.zygote ")


@pytest.mark.parametrize(
    ("change", "warm"),
    [
        ({}, True),
        ({"gpus_per_node": 8, "instance_type": "p5.48xlarge"}, False),  # the zygote step's GPUs: unchecked
        ({"gpus_per_node": 8, "resilience": {"warm_start": True}}, True),
        ({"resilience": {"warm_start": False}}, False),
        ({"launcher": "srun"}, True),
        ({"launcher": "mpi"}, True),
        ({"container": {"image": "img.sqsh"}}, False),
        # Slurm's own OCI containers fork warm only when asked: submit checks the cluster's version for it
        ({"container": {"runtime": "oci", "image": "/b"}, "resilience": {}}, False),
        ({"container": {"runtime": "oci", "image": "/b"}, "resilience": {"warm_start": True}}, True),
        # the zygote would refuse an interpreter option
        ({"command": ["/opt/venv/bin/python", "-u", "-m", "hpkit", "train"]}, False),
        # the default command, hpkit's own script: `python3 -m hpkit train`
        ({"command": ["hpkit", "train"]}, True),
        ({"command": ["/opt/venv/bin/hpkit", "train"]}, False),  # by a path: which Python it names is unknown
    ],
)
def test_warm_start_left_out_is_on_where_it_can_be_in_a_job_without_gpus(change: dict, warm: bool) -> None:
    spec = {**WARM_SPEC, "resilience": {}, **change}
    script = render(parse_document(JobSpec, spec))
    assert ("hpkit.warm.zygote" in script) is warm
    assert ("hpkit.warm.client" in script) is warm


def refused_in_one_line(change: dict, words: str) -> None:
    """WARM_SPEC with `change` is refused with one line holding `words`."""
    with pytest.raises(SpecError) as info:
        parse_document(JobSpec, {**WARM_SPEC, **change}, "job.yaml")
    assert words in str(info.value)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"container": {"image": "img.sqsh"}},
            "resilience.warm_start: ranks are forked warm only outside a container or in Slurm's own OCI "
            "containers (container.runtime: oci); use runtime oci, or drop the container",
        ),
        (
            {"command": ["/opt/venv/bin/hpkit", "train"]},
            "resilience.warm_start: the command must be a Python program",
        ),
        (
            {"command": ["python3", "-c", "pass"]},
            "resilience.warm_start: the command must be a Python program",
        ),
        (
            {"command": ["python3", "-u", "train.py"]},
            "resilience.warm_start: the command must be a Python program without interpreter options",
        ),
    ],
)
def test_warm_start_where_it_cannot_apply_is_one_line(change: dict, words: str) -> None:
    refused_in_one_line(change, words)


def test_warm_preload_adds_its_modules_to_the_zygotes_preload_once() -> None:
    spec = {
        **WARM_SPEC,
        "resilience": {
            "warm_start": True,
            "warm_preload": ["transformers.models.llama.modeling_llama", "torch", "numpy"],
        },
    }
    script = render(parse_document(JobSpec, spec))
    plan = json.loads(shlex.split(re.search(r"--plan ('.*?'|\S+) --step", script).group(1))[0])
    assert shlex.split(plan["warm"])[-2:] == [
        "--preload=torch,torch._dynamo,torch.distributed.run,hpkit.torchrun_agent,hpkit.run_script,hpkit.cli,hpkit.commands.train,"
        "hpkit.runtime.run",
        "--preload-more=transformers.models.llama.modeling_llama,numpy",
    ], plan["warm"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"resilience": {"warm_preload": ["transformers,torch"]}},
            "resilience.warm_preload: 'transformers,torch' is not a module name",
        ),
        ({"resilience": {"warm_preload": ["a b"]}}, "resilience.warm_preload: 'a b' is not a module name"),
        ({"resilience": {"warm_preload": ["tråd"]}}, "resilience.warm_preload: 'tråd' is not a module name"),
        ({"resilience": {"warm_preload": "transformers"}}, "resilience.warm_preload: "),
        (
            {"resilience": {"warm_start": False, "warm_preload": ["transformers"]}},
            "resilience.warm_preload: the ranks start cold in this job (warm_start: false)",
        ),
        (
            {"gpus_per_node": 8, "resilience": {"warm_preload": ["transformers"]}},
            "resilience.warm_preload: the ranks start cold in this job (warm starts are off on GPU nodes unless "
            "warm_start: true)",
        ),
        (
            {"container": {"image": "img.sqsh"}, "resilience": {"warm_preload": ["transformers"]}},
            "resilience.warm_preload: the ranks start cold in this job (ranks are forked warm only outside",
        ),
    ],
)
def test_warm_preload_that_cannot_apply_is_one_line(change: dict, words: str) -> None:
    refused_in_one_line(change, words)


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"resilience": {"warm_start": False, "keep_survivors": True}},
            "resilience.keep_survivors: a rank stays in a process its node's warm process forked, and the ranks of "
            "this job start cold (warm_start: false); turn resilience.warm_start on, or drop keep_survivors",
        ),
        (
            {"gpus_per_node": 8, "resilience": {"keep_survivors": True}},
            "(warm starts are off on GPU nodes unless warm_start: true)",
        ),
        (
            {"command": ["python3", "train.py"], "resilience": {"keep_survivors": True}},
            "resilience.keep_survivors: only hpkit train's ranks stay in their processes",
        ),
    ],
)
def test_keep_survivors_that_cannot_apply_is_one_line(change: dict, words: str) -> None:
    refused_in_one_line(change, words)


@pytest.mark.parametrize(
    "change, kept",
    [
        ({}, True),  # left out: on for warm ranks on CPUs
        ({"resilience": {"keep_survivors": True}}, True),
        ({"resilience": {"keep_survivors": False}}, False),
        ({"resilience": {"warm_start": False}}, False),
        ({"command": ["python3", "train.py"]}, False),
        ({"gpus_per_node": 8, "resilience": {"warm_start": True}}, False),  # left out: off on GPUs (NCCL)
        ({"gpus_per_node": 8, "resilience": {"warm_start": True, "keep_survivors": True}}, True),
    ],
)
def test_keep_survivors_or_its_default_reaches_the_supervisors_plan(change: dict, kept: bool) -> None:
    """The supervisor watches every step for a failing one where ranks may stay (their tasks do not end): where
    keep_survivors is left out, for warm `hpkit train` ranks on CPUs, and never for ranks that start cold or run
    another command."""
    document = {
        **WARM_SPEC,
        **change,
        "resilience": {**WARM_SPEC["resilience"], **change.get("resilience", {})},
    }
    script = render(parse_document(JobSpec, document, "job.yaml"))
    assert ('"keep_survivors": true' in script) == kept, change


def test_a_job_module_that_leaves_a_thread_running_makes_ranks_start_cold_with_one_line(
    tmp_path: Path,
) -> None:
    """resilience.warm_preload's modules come after hpkit's own: a thread one of them leaves running would be missing
    in every forked rank (a fork copies the forking thread only), so the zygote says so and refuses every fork."""
    # A native thread, no Python one (a Python thread is refused by its own check): faulthandler's watchdog.
    (tmp_path / "starts_a_pool.py").write_text(
        "import faulthandler\nfaulthandler.dump_traceback_later(3600)\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HPKIT_", "SLURM"))}
    env = {**base, "PYTHONPATH": str(tmp_path), protocol.SOCKET_ENV: str(tmp_path / "own" / "z.sock")}
    proc = subprocess.Popen(
        [PY, "-m", "hpkit.warm.zygote", "--preload", "json", "--preload-more", "starts_a_pool"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline()
        assert said.startswith("hpkit: warm: preloading starts_a_pool left 1 more thread(s) running"), said
        assert "take the module that starts them out of resilience.warm_preload" in said
        assert "ready" in proc.stdout.readline()
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        (tmp_path / "rank.py").write_text("print('ran')\n")
        rank = subprocess.run(
            [PY, "-m", "hpkit.warm.client", "--", PY, str(tmp_path / "rank.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert rank.returncode == 0 and rank.stdout == "ran\n", rank.stderr
        # It ran cold, and said why.
        assert "warm start refused" in rank.stderr and "more than its imports left" in rank.stderr, (
            rank.stderr
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)


OCI_WARM_SPEC = {**WARM_SPEC, "container": {"runtime": "oci", "image": "/images/hpkit-cpu"}}


def test_in_an_oci_container_the_zygote_starts_with_the_image_s_path() -> None:
    """The zygote's step runs in the job's containers too (the supervisor's srun arguments): its python3 must be the
    image's, as the ranks' (render.oci_path_step), or it would import the host's hpkit and torch."""
    script = render(
        parse_document(JobSpec, {**OCI_WARM_SPEC, "command": ["python3", "-m", "hpkit", "train"]})
    )
    plan = json.loads(shlex.split(re.search(r"--plan ('.*?'|\S+) --step", script).group(1))[0])
    wrapper, zygote = plan["warm"].split(" hpkit-task ", 1)
    assert 'export PATH="${HPKIT_IMAGE_PATH:-$PATH}"' in shlex.split(wrapper)[2], plan["warm"]
    assert zygote.startswith("python3 -m hpkit.warm.zygote ")


@pytest.mark.parametrize(
    ("version", "refused"),
    [((22, 5), True), ((23, 11), True), ((24, 11), False), ((25, 5), False)],
)
def test_warm_starts_in_oci_containers_need_slurm_24_11_at_submit(version, refused) -> None:
    spec = parse_document(JobSpec, OCI_WARM_SPEC)
    problem = oci_warm_problem(spec.job, spec.warm_starts, lambda: version)
    if not refused:
        assert problem is None
        return
    assert problem is not None and len(problem.splitlines()) == 1
    assert problem.startswith(
        "resilience.warm_start: ranks cannot fork warm in container.runtime oci on Slurm "
    )
    assert f"{version[0]}.{version[1]:02d}" in problem and "run on Slurm 24.11 or later" in problem


def test_warm_starts_in_oci_containers_where_the_version_cannot_be_read_are_refused_with_the_reason() -> None:
    spec = parse_document(JobSpec, OCI_WARM_SPEC)

    def unreadable() -> tuple[int, int]:
        raise HpkitError("sinfo: command not found")

    problem = oci_warm_problem(spec.job, spec.warm_starts, unreadable)
    assert problem is not None and "sinfo: command not found" in problem and "drop warm_start" in problem
    # Cold ranks, outside a container or not asked for: the version is never read.
    for cold in ({**OCI_WARM_SPEC, "resilience": {}}, {**WARM_SPEC, "resilience": {"warm_start": False}}):
        spec = parse_document(JobSpec, cold)
        assert oci_warm_problem(spec.job, spec.warm_starts, unreadable) is None


def test_warm_preload_in_a_container_without_warm_start_says_warm_starts_are_off_there() -> None:
    spec = {**OCI_WARM_SPEC, "resilience": {"warm_preload": ["numpy"]}}
    with pytest.raises(SpecError) as info:
        parse_document(JobSpec, spec, "job.yaml")
    assert (
        "resilience.warm_preload: the ranks start cold in this job (warm starts are off in a container unless "
        "warm_start: true)" in str(info.value)
    )


# A rank that may stay (hpkit.warm.park): it says who it is, offers to park, and on "park" from its stdin parks;
# adopted, it says who it is now, echoes its new stdin's next line and exits 5. "linger" never parks (blocked); "train-on"
# trains on until the zygote says its step ended, then parks.
STAYING_RANK = r"""
import os, sys, signal
from hpkit.warm import park
park.watch_step_end()  # as hpkit train's offer does: the zygote's "step ended" word may come at any time from here
park.offer()
print("rank", os.getpid(), os.getppid(), os.environ.get("WHO"), park.available(), park.adoptions, flush=True)
what = sys.stdin.readline().strip()
if what == "park" and park.stay():
    print("adopted", os.getpid(), os.environ.get("WHO"), os.getcwd(), park.adoptions, flush=True)
    print("echo", sys.stdin.readline().strip(), flush=True)
    sys.exit(5)
if what == "train-on":  # healthy, its group whole: it learns from the zygote that its step has ended
    import time
    print("training", flush=True)
    while not park.step_ended:
        time.sleep(0.01)
    if park.stay():
        print("adopted", os.getpid(), os.environ.get("WHO"), os.getcwd(), park.adoptions, park.step_ended, flush=True)
        sys.exit(6)
if what == "linger":  # blocked (a collective that cannot be interrupted): told its step ended, it cannot act on it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("lingering", flush=True)
    while True:
        signal.pause()
sys.exit(0)
"""


@contextlib.contextmanager
def park_zygote(root: Path, window_s: float) -> Iterator[tuple[subprocess.Popen[str], Path, list[str]]]:
    """A zygote whose ranks have `window_s` to park after their client went, and that ends a parked rank after
    3 s; its lines are kept."""
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "hpkit.warm.zygote",
            "--preload",
            "json",
            "--park-window-s",
            str(window_s),
            "--park-s",
            "3",
        ],
        env=job_env(root),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert "ready" in proc.stdout.readline()
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    yield proc, root, lines
    proc.terminate()
    assert proc.wait(timeout=60) == 0


@pytest.fixture
def short_park(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, list[str]]]:
    """park_zygote with a window long enough for a rank to park on a loaded machine (30 s): only the window's own
    test waits one out."""
    with park_zygote(tmp_path, 30) as zygote:
        yield zygote


def zygote_said(lines: list[str], what: str) -> None:
    """Waits (up to a minute) for a zygote line containing `what`."""
    for _ in range(600):
        if any(what in line for line in lines):
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"no line with {what!r} in {lines}")


def wait_parked(pid: int) -> None:
    """Waits (up to a minute) until the rank has parked: its stdout is /dev/null (hpkit.warm.park.stay)."""
    for _ in range(600):
        if os.readlink(f"/proc/{pid}/fd/1") == os.devnull:
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"process {pid} did not park")


def test_a_parked_rank_is_adopted_by_the_next_client_of_its_command(short_park, tmp_path: Path) -> None:
    """The rank parks, its client is killed, and the next client with the same command gets that same process,
    which goes on with the new client's environment, folder, stdin and stdout, and ends with its status."""
    proc, root, lines = short_park
    script = tmp_path / "stay.py"
    script.write_text(STAYING_RANK)
    first = client(root, [PY, str(script)])
    pid, parent = rank_line(first)
    assert parent == proc.pid
    assert first.stdin is not None
    first.stdin.write("park\n")
    first.stdin.flush()
    wait_parked(pid)
    first.kill()
    first.wait(timeout=60)
    later = tmp_path / "later"
    later.mkdir()
    second = client(root, [PY, str(script)], env={"WHO": "next"}, cwd=later)
    out, _ = second.communicate("hello\n", timeout=60)
    assert f"adopted {pid} next {later} 1" in out, (out, lines)
    assert "echo hello" in out
    assert second.returncode == 5
    assert any(f"adopted process {pid}" in line for line in lines), lines


def test_a_parked_rank_another_command_asks_for_is_left_and_ended_later(short_park, tmp_path: Path) -> None:
    """A request for another command forks a new process; the parked one, adopted by none, ends after --park-s
    with a line."""
    _, root, lines = short_park
    script = tmp_path / "stay.py"
    script.write_text(STAYING_RANK)
    first = client(root, [PY, str(script)])
    pid, _ = rank_line(first)
    assert first.stdin is not None
    first.stdin.write("park\n")
    first.stdin.flush()
    wait_parked(pid)
    first.kill()
    first.wait(timeout=60)
    other = client(root, [PY, str(script), "other"])
    new_pid, _ = rank_line(other)
    assert new_pid != pid
    other.communicate("done\n", timeout=60)
    zygote_said(
        lines, f"(process {pid}, attempt ?) stayed for the next step, and none took it over within 3 s: ended"
    )
    wait_gone(pid)


def rank_whose_client_died(root: Path, script: Path, doing: str = "linger") -> int:
    """A STAYING_RANK that offered to stay and is `doing` ("linger": blocked; "train-on": its group still works),
    its client then killed: its pid."""
    first = client(root, [PY, str(script)])
    pid, _ = rank_line(first)
    assert first.stdin is not None and first.stdout is not None
    first.stdin.write(f"{doing}\n")
    first.stdin.flush()
    assert first.stdout.readline().strip() == {"linger": "lingering", "train-on": "training"}[doing]
    first.kill()
    first.wait(timeout=60)
    return pid


def test_a_rank_that_may_stay_but_does_not_park_is_killed_after_the_window(tmp_path: Path) -> None:
    """A rank that said it may stay but is still busy (a collective that cannot be interrupted) when its client
    goes is killed once the window has passed, with a line (one that never offered dies with its client at once:
    test_client_killed_kills_its_rank)."""
    with park_zygote(tmp_path, 2) as (_, root, lines):
        script = tmp_path / "stay.py"
        script.write_text(STAYING_RANK)
        pid = rank_whose_client_died(root, script)
        zygote_said(lines, f"(process {pid}, attempt ?) had not left its step 2 s after the step ended")
        wait_gone(pid)


def test_a_rank_still_leaving_its_step_is_killed_when_the_next_one_starts_on_its_node(
    short_park, tmp_path
) -> None:
    """The next step's process for the same command does not start beside one still leaving the old step (both
    would hold the node's memory, a GPU's): that one is killed first, with a line, before the window is out."""
    _, root, lines = short_park
    script = tmp_path / "stay.py"
    script.write_text(STAYING_RANK)
    pid = rank_whose_client_died(root, script)
    second = client(root, [PY, str(script)])
    new_pid, _ = rank_line(second)
    zygote_said(
        lines, f"(process {pid}, attempt ?) had not left its step when the next step's rank started here"
    )
    wait_gone(pid)
    assert new_pid != pid
    second.communicate("done\n", timeout=60)


def test_a_rank_whose_client_goes_while_it_trains_on_is_told_its_step_ended_and_parks(
    short_park, tmp_path
) -> None:
    """Its client killed while its group still works (its peers' clients too: a step stopped for another rank's
    hang): the zygote tells it its step ended (park.STEP_ENDED_SIGNAL) instead of leaving it to train and save on in
    a step that is over, and it parks, adopted by the next client of its command."""
    _, root, _ = short_park
    script = tmp_path / "stay.py"
    script.write_text(STAYING_RANK)
    pid = rank_whose_client_died(root, script, "train-on")
    wait_parked(pid)
    second = client(root, [PY, str(script)], env={"WHO": "next"})
    out, _ = second.communicate(timeout=60)
    assert f"adopted {pid} next" in out and out.strip().endswith("1 False"), out
    assert second.returncode == 6


def test_a_parked_ranks_client_ends_with_the_stayed_status_and_the_next_client_adopts_the_rank(
    short_park, tmp_path
) -> None:
    """Once its rank has parked, the client ends by itself (protocol.STAYED_EXIT), so its launcher (torchrun's
    agent, srun) ends the step as for a failed rank instead of waiting for a process that will not end; the rank
    stays, and the next client of its command gets it."""
    _, root, _ = short_park
    script = tmp_path / "stay.py"
    script.write_text(STAYING_RANK)
    first = client(root, [PY, str(script)])
    pid, _ = rank_line(first)
    assert first.stdin is not None
    first.stdin.write("park\n")
    first.stdin.flush()
    assert first.wait(timeout=60) == protocol.STAYED_EXIT
    second = client(root, [PY, str(script)], env={"WHO": "next"})
    out, _ = second.communicate("hello\n", timeout=60)
    assert f"adopted {pid} next" in out and second.returncode == 5, out
