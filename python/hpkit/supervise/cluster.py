"""The supervisor's one boundary to Slurm: `Cluster` (a protocol), and `SlurmCli`, which runs srun itself and
asks everything else of hpkit.slurm.client.

Everything the state machine (hpkit.supervise.machine) asks of Slurm or of the clock goes through here, so
that a test hands it a scripted fake.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from hpkit.job_events import RankFailed, RankStays, parse_rank_failed_line, parse_stays_line
from hpkit.slurm import client, hostlist
from hpkit.supervise import probe
from hpkit.supervise.probe import PROBE_TIMEOUT_S, launch_failed_node, silent_nodes

# srun's line for a task that failed: "srun: error: NODE: task(s) N[,M-K]: Exited with exit code C".
_TASK_ERROR = re.compile(r"^srun: error: ([^:\s]+): tasks? ([\d,\-]+): (.+)$")
PROBE_POLL_S = 0.05
LISTEN_TIMEOUT_S = 1.0  # a connect that takes longer is no answer (a node cut off)
NODES_ANSWER_TIMEOUT_S = 60
# The name of the background step that keeps a zygote on each node (hpkit.warm, resilience.warm_start).
WARM_STEP_NAME = "hpkit-warm"
SLURM_TIMEOUT_S = 60  # a controller that is itself recovering a node may answer slowly: the supervisor waits


@dataclass(frozen=True)
class TaskExit:
    """One of srun's per-task error lines."""

    node: str
    tasks: str  # "1" or "0,2-3", as srun writes it
    outcome: str  # "Exited with exit code 3", "Killed", "Terminated"

    @property
    def exit_code(self) -> int | None:
        match = re.match(r"Exited with exit code (\d+)", self.outcome)
        return int(match.group(1)) if match else None

    @property
    def killed(self) -> bool:
        """The task died of SIGKILL (the OOM killer, an operator, a node's health agent), or, under torchrun,
        its agent reports a rank that did (hpkit-torchrun exits 128 + the signal then)."""
        return self.outcome == "Killed" or self.exit_code == 128 + signal.SIGKILL

    @property
    def task_ids(self) -> list[int]:
        """The task ids `tasks` names ("0,2-3" -> [0, 2, 3])."""
        ids: list[int] = []
        for part in self.tasks.split(","):
            first, _, last = part.strip().partition("-")
            if first.isdigit():
                ids += range(int(first), int(last if last.isdigit() else first) + 1)
        return ids

    @classmethod
    def parse(cls, line: str) -> TaskExit | None:
        match = _TASK_ERROR.match(line.strip())
        return cls(match.group(1), match.group(2), match.group(3).strip()) if match else None


class Step(Protocol):
    """A running `srun` of the job's launch command."""

    def poll(self) -> int | None: ...
    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the step to end (returns at once when it does)."""
        ...

    def task_exits(self) -> list[TaskExit]: ...
    def failed_ranks(self) -> list[RankFailed]:
        """The ranks hpkit-torchrun said failed (job_events.rank_failed_line), each with its node."""
        ...

    def staying_ranks(self) -> list[RankStays]:
        """The ranks hpkit train said stay in their processes for the next step (job_events.stays_line): their
        group broke, and their tasks do not end."""
        ...

    def ready(self) -> set[str]:
        """What the step has said is ready: the names `ready_when` (start_step) found in its lines; empty without."""
        ...

    def signal(self, signum: int) -> None: ...
    def kill(self) -> None: ...
    def wait(self) -> int: ...
    def end(self, grace_s: float) -> None:
        """Stop a step on purpose, its run being over: SIGTERM, then SIGKILL after `grace_s`. What srun says of
        the stop is not passed on."""
        ...


class Cluster(Protocol):
    def start_step(
        self,
        srun_args: Sequence[str],
        env: Mapping[str, str],
        ready_when: Callable[[str], str | None] | None = None,
    ) -> Step:
        """Start `srun_args`. With `ready_when`, the step's standard output is read (and passed on) line by line,
        and each name `ready_when` returns for a line (a node whose task says it serves) joins the step's ready()."""
        ...

    def unanswering(self, nodes: Sequence[str]) -> list[str]:
        """The nodes, of those given, that do not start a task in time (hpkit.supervise.probe says how long)."""
        ...

    def all_answer(self, node_count: int) -> bool:
        """Whether every node of the job still starts a task (a dead slurmd fails this at once)."""
        ...

    def lost_nodes(self, nodelist: str, states: str) -> list[str]:
        """The nodes of `nodelist` that slurmctld calls gone: sinfo's %t matches `states`."""
        ...

    def hostnames(self, nodelist: str) -> list[str]: ...
    def node_addr(self, node: str) -> str: ...
    def slurmd_timeout(self) -> int: ...
    def set_requeue(self, job_id: str, on: bool) -> bool: ...
    def requeue(self, job_id: str) -> bool: ...
    def replace_node(self, node: str) -> bool:
        """HyperPod: set the node to fail with reason Action:Replace, which its agent acts on."""
        ...

    def cancel_steps(self, job_id: str) -> None:
        """SIGKILL what is left of the job's steps (in the background: slurmctld may be trying a dead node)."""
        ...

    def listens(self, addr: str, port: int) -> bool:
        """Whether something accepts connections on addr:port (a stopped step's rendezvous store, still ending)."""
        ...

    def hyperpod(self) -> bool: ...
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


def task_on_each_node(nodes: Sequence[str]) -> list[str]:
    """srun options for a step beside the training steps with one task on each of `nodes`, which a lost node does not
    end: slurmctld then ends only that node's task (--no-kill; checked on 22.05 and 24.11), and a task that exits ends
    no other (--kill-on-bad-exit=0). The probe and the warm-start zygotes use it."""
    return [
        "--overlap",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={hostlist.compress(nodes)}",
        "--no-kill",
        "--kill-on-bad-exit=0",
    ]


class _SrunStep:
    """srun in its own process group: its stderr is passed through, and its per-task error lines kept; with
    `ready_when`, its stdout too, watched for the lines that say a task is ready."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        ready_when: Callable[[str], str | None] | None = None,
    ):
        stdout = subprocess.PIPE if ready_when is not None else None
        self._proc = subprocess.Popen(list(argv), env=dict(env), stdout=stdout, stderr=subprocess.PIPE)
        self._exits: list[TaskExit] = []
        self._failed: list[RankFailed] = []
        self._stays: list[RankStays] = []
        self._lock = threading.Lock()
        # Set by end(): srun's lines from then on are about the stop ("forcing job termination", each task
        # "Killed"), which read as a fault in a log that has just said the job completed.
        self._ending = threading.Event()
        self._ready: set[str] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if ready_when is not None:
            threading.Thread(target=self._watch, args=(ready_when,), daemon=True).start()

    def _watch(self, ready_when: Callable[[str], str | None]) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            if not self._ending.is_set():
                sys.stdout.buffer.write(raw)
                sys.stdout.buffer.flush()
            name = ready_when(raw.decode(errors="replace"))
            if name:
                with self._lock:
                    self._ready.add(name)

    def ready(self) -> set[str]:
        with self._lock:
            return set(self._ready)

    def _read(self) -> None:
        assert self._proc.stderr is not None
        for raw in self._proc.stderr:
            if not self._ending.is_set():
                sys.stderr.buffer.write(raw)
                sys.stderr.buffer.flush()
            line = raw.decode(errors="replace")
            task = TaskExit.parse(line)
            failed = parse_rank_failed_line(line) if task is None else None
            stays = parse_stays_line(line) if task is None and failed is None else None
            with self._lock:
                if task is not None:
                    self._exits.append(task)
                if failed is not None:
                    self._failed.append(failed)
                if stays is not None:
                    self._stays.append(stays)

    def poll(self) -> int | None:
        return self._proc.poll()

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout)

    def task_exits(self) -> list[TaskExit]:
        with self._lock:
            return list(self._exits)

    def failed_ranks(self) -> list[RankFailed]:
        with self._lock:
            return list(self._failed)

    def staying_ranks(self) -> list[RankStays]:
        with self._lock:
            return list(self._stays)

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def end(self, grace_s: float) -> None:
        self._ending.set()
        self.signal(signal.SIGTERM)
        self.join(grace_s)
        if self.poll() is None:
            self.kill()

    def wait(self) -> int:
        status = self._proc.wait()
        self._reader.join(timeout=5)
        return status if status >= 0 else 128 - status


def _run(args: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


class SlurmCli:
    """The real cluster: Slurm's commands on the batch host."""

    def start_step(
        self,
        srun_args: Sequence[str],
        env: Mapping[str, str],
        ready_when: Callable[[str], str | None] | None = None,
    ) -> Step:
        return _SrunStep(srun_args, env, ready_when)

    def unanswering(self, nodes: Sequence[str]) -> list[str]:
        """One srun over all the nodes, each task printing its node's name: one step for slurmctld to create and
        one process here, where a probe per node made as many of each (at 64 nodes: the last answer at 0.8 s
        against 1.3 s; at thousands, more than the probe's whole timeout). srun aborts the step when a task's
        launch fails and names that node; what it leaves unknown, hpkit.supervise.probe.unanswering settles."""
        return probe.unanswering(
            nodes,
            self._probe_together,
            lambda unknown: self.lost_nodes(hostlist.compress(unknown), probe.LOST_NODE_STATES),
            self._probe_each,
        )

    def _probe_together(self, nodes: Sequence[str]) -> tuple[dict[str, float], list[str], bool]:
        """The nodes that answered (seconds), those whose launch srun says failed, and whether srun ended by
        itself before the probe had its answer (hpkit.supervise.probe)."""
        argv = ["srun", *task_on_each_node(nodes), "--time=1", "printenv", "SLURMD_NODENAME"]
        answered: dict[str, float] = {}
        failed: list[str] = []
        names = set(nodes)
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError:
            return answered, failed, True
        assert proc.stdout is not None and proc.stderr is not None
        began = time.monotonic()
        texts = {proc.stdout: b"", proc.stderr: b""}
        with selectors.DefaultSelector() as selector:
            for pipe in texts:
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map():
                for key, _ in selector.select(timeout=PROBE_POLL_S):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    *lines, texts[key.fileobj] = (texts[key.fileobj] + chunk).split(b"\n")
                    for line in (raw.decode(errors="replace").strip() for raw in lines):
                        if key.fileobj is proc.stdout and line in names:
                            answered.setdefault(line, time.monotonic() - began)
                        elif (node := launch_failed_node(line)) in names and node not in failed:
                            failed.append(node)
                if silent_nodes(nodes, answered, failed, time.monotonic() - began) is not None:
                    break
            else:
                # Both pipes closed: srun is ending by itself (it can fail at once: "Unable to create step"), though
                # poll() may not see it yet. Taken for still running, every node that had not answered was silent.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(PROBE_TIMEOUT_S)
        ended = proc.poll() is not None
        if not ended:
            proc.kill()
        proc.wait()
        for pipe in texts:
            pipe.close()
        return answered, failed, ended

    def _probe_each(self, nodes: Sequence[str]) -> list[str]:
        """A one-task srun per node: where the probe of all of them together could not tell."""
        probes = [
            (
                node,
                subprocess.Popen(
                    [
                        "srun",
                        "--overlap",
                        "--nodes=1",
                        "--ntasks=1",
                        f"--nodelist={node}",
                        "--time=1",
                        "true",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
            for node in nodes
        ]
        began = time.monotonic()
        answered: dict[str, float] = {}
        failed: list[str] = []
        while True:
            elapsed = time.monotonic() - began
            for node, proc in probes:
                if node in answered or node in failed or (status := proc.poll()) is None:
                    continue
                if status == 0:
                    answered[node] = elapsed
                else:
                    failed.append(node)
            silent = silent_nodes(nodes, answered, failed, elapsed)
            if silent is not None:
                break
            time.sleep(PROBE_POLL_S)
        for _, proc in probes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return silent

    def all_answer(self, node_count: int) -> bool:
        done = _run(
            ["srun", "--overlap", f"--nodes={node_count}", "--ntasks-per-node=1", "--time=1", "true"],
            timeout=NODES_ANSWER_TIMEOUT_S,
        )
        return done is not None and done.returncode == 0

    def lost_nodes(self, nodelist: str, states: str) -> list[str]:
        if not nodelist:
            return []
        done = client.node_states(nodelist, timeout_s=SLURM_TIMEOUT_S)
        if not done.ok:
            return []
        lost = {
            words[0]
            for line in done.out.splitlines()
            if len(words := line.split()) == 2 and re.search(states, words[1])
        }
        return sorted(lost)

    def hostnames(self, nodelist: str) -> list[str]:
        try:
            return hostlist.expand(nodelist)
        except hostlist.HostlistError:
            return []

    def node_addr(self, node: str) -> str:
        done = client.show_node(node, timeout_s=SLURM_TIMEOUT_S)
        return (client.node_addr(done.out) if done.ok else None) or node

    def slurmd_timeout(self) -> int:
        done = client.show_config(timeout_s=SLURM_TIMEOUT_S)
        match = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", done.out, re.M) if done.ok else None
        return int(match.group(1)) if match else 300

    def set_requeue(self, job_id: str, on: bool) -> bool:
        return client.set_requeue(job_id, on, SLURM_TIMEOUT_S).ok

    def requeue(self, job_id: str) -> bool:
        return client.requeue(job_id, SLURM_TIMEOUT_S).ok

    def replace_node(self, node: str) -> bool:
        return client.fail_node(node, "Action:Replace", SLURM_TIMEOUT_S).ok

    def cancel_steps(self, job_id: str) -> None:
        def cancel() -> None:
            # The zygotes' step (resilience.warm_start) lasts the allocation: the next step's ranks fork from it.
            for step in client.job_steps(job_id, SLURM_TIMEOUT_S, except_named=WARM_STEP_NAME):
                if not step.endswith((".batch", ".extern")):
                    client.kill_step(step, SLURM_TIMEOUT_S)

        threading.Thread(target=cancel, daemon=True).start()

    def listens(self, addr: str, port: int) -> bool:
        try:
            with socket.create_connection((addr, port), timeout=LISTEN_TIMEOUT_S):
                return True
        except OSError:
            return False

    def hyperpod(self) -> bool:
        return os.path.isdir("/opt/sagemaker_cluster")

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
