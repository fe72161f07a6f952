"""hpkit-torchrun: the rendezvous store outlives every agent, and a taken port is named at once.

Two agents on this host stand for two nodes (SLURMD_NODENAME a and b, the store on a). The second agent
closes the rendezvous LATE_CLOSE_S late (a sitecustomize on its PYTHONPATH delays torch's own close, as a loaded
node does): plain torchrun's store host has exited by then (its close fails: "failed to shutdown the
rendezvous"), hpkit-torchrun's has not. Plain torchrun is not run beside it: whether its host is gone in
time depends on the machine's load, and a control that flakes proves nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from _torchrun import REPO, torch_env

from hpkit.rendezvous import free_local_ports

LATE_CLOSE_S = 4.0

SLOW_CLOSE = """
import os, time
if os.environ.get("LATE_CLOSE_S") and "LOCAL_RANK" not in os.environ:  # the agent, not its workers
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.DynamicRendezvousHandler.shutdown

    def shutdown(self):
        time.sleep(float(os.environ["LATE_CLOSE_S"]))
        try:
            return original(self)
        finally:
            with open(os.environ["CLOSED_AT"], "w") as out:
                out.write(repr(time.time()))

    dynamic_rendezvous.DynamicRendezvousHandler.shutdown = shutdown
"""

WORKER = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""

AGENT_FAILURES = ("failed to shutdown the rendezvous", "Failed to recv", "Traceback")


class Agent:
    """One launcher process standing for one node; remembers when it exited."""

    def __init__(self, launcher: list[str], node: str, port: int, tmp: Path, late_close: bool) -> None:
        env = torch_env(tmp / node)
        env.update(SLURMD_NODENAME=node, HPKIT_RDZV_NODE="a")
        if late_close:
            (tmp / "late").mkdir(exist_ok=True)
            (tmp / "late" / "sitecustomize.py").write_text(SLOW_CLOSE)
            env["PYTHONPATH"] = os.pathsep.join([str(tmp / "late"), env["PYTHONPATH"]])
            env.update(LATE_CLOSE_S=str(LATE_CLOSE_S), CLOSED_AT=str(tmp / "closed_at"))
        (tmp / "worker.py").write_text(WORKER)
        args = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=agent-test-{port}",
            str(tmp / "worker.py"),
        ]
        self.proc = subprocess.Popen(
            [*launcher, *args], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.exited_at = 0.0
        self.output = ""
        self._waiter = threading.Thread(target=self._wait)
        self._waiter.start()

    def _wait(self) -> None:
        self.output, _ = self.proc.communicate(timeout=180)
        self.exited_at = time.time()

    def join(self) -> int:
        self._waiter.join()
        return self.proc.returncode


def listening(port: int) -> bool:
    """Whether a socket on this host listens on `port` (read from the kernel: a probe connection would
    make the store log a bad client)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def start_pair(launcher: list[str], tmp: Path) -> tuple[Agent, Agent]:
    """The store's agent (a), and once it listens the late-closing one (b)."""
    tmp.mkdir(parents=True)
    port = free_local_ports()
    host = Agent(launcher, "a", port, tmp, late_close=False)
    deadline = time.monotonic() + 60
    while not listening(port):
        assert host.proc.poll() is None and time.monotonic() < deadline, "the store's agent never listened"
        time.sleep(0.05)
    return host, Agent(launcher, "b", port, tmp, late_close=True)


def test_the_store_outlives_an_agent_that_closes_late(tmp_path):
    host, late = start_pair([sys.executable, "-m", "hpkit.torchrun_agent"], tmp_path / "hpkit-torchrun")

    assert (host.join(), late.join()) == (0, 0), host.output + late.output
    closed_at = float((tmp_path / "hpkit-torchrun" / "closed_at").read_text())
    assert host.exited_at >= closed_at, "the store's host exited before the other agent closed the rendezvous"
    assert not [line for line in late.output.splitlines() if any(f in line for f in AGENT_FAILURES)], (
        late.output
    )


def test_a_taken_rendezvous_port_is_named_at_once(tmp_path):
    """torchrun's store host would become a client of whatever holds the port and wait minutes."""
    with socket.socket() as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = {**torch_env(tmp_path), "SLURMD_NODENAME": "a", "HPKIT_RDZV_NODE": "a"}
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "hpkit.torchrun_agent",
                "--nnodes=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=taken",
                "--no-python",
                "true",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"cannot serve the rendezvous store on port {port} of a" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert time.monotonic() - started < 30
