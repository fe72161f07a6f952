"""One hang drill: a real `hpkit train` on two "nodes" of two ranks each (two torchrun agents on this host, each
with its own SLURMD_NODENAME, FSDP x TP over gloo), a fault injected on one rank or one node, and the watchdog's
verdict read back. The bench (bench_hang_detection.py) repeats it per fault type; the integration test
(tests/integration/test_hang_culprits.py) runs one of each kind it checks.

Faults, and where their timestamp comes from:
- `sigstop`: SIGSTOP to one rank's process (the drill's clock, just before the signal);
- `sleep`: the rank sleeps in Python before a step (HPKIT_FAULT hang, its own log line's clock);
- `skip`: the rank leaves out the step's loss all-reduce and goes on (HPKIT_FAULT skip, its log line's clock);
- `sigstop-in-save`: SIGSTOP to one rank inside a checkpoint save (HPKIT_FAULT slow_save holds every rank in
  the save of step FAULT_STEP for SAVE_HOLD_S; the signal once every rank's fault line is written): its peers
  wait for it in the save, still saying "save" (the drill's clock);
- `frozen-node`: SIGSTOP to every process of one node, its torchrun agent included (the drill's clock).
  Node 0 (nodeA) holds rank 0 and torchrun's store, which carries the watchdog's reports: its freezing is
  found by the store's silence (reason "store"). Node 1 (nodeB) holds the judge: its freezing is found by the
  standby on node 0 (reason "stopped").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from _sides import REPO, run_env
from hpkit.rendezvous import free_local_ports
from hpkit.runtime.watchdog.hang_board import clear_reports, reports_of

NODES = ("nodeA", "nodeB")
PER_NODE = 2
FAULT_STEP = 6
FAULTS = ("sigstop", "sleep", "skip", "frozen-node", "sigstop-in-save")
# How long slow_save holds each rank in the save of FAULT_STEP: far longer than the detection takes.
SAVE_HOLD_S = 60


@dataclass
class Trial:
    fault: str
    target: int  # the rank (or, for frozen-node, the node index) the fault hits
    injected_at: float = 0.0
    verdict: dict | None = None
    verdict_at: float = 0.0
    log: str = ""
    clean_verdict: bool = False  # a hang was called during the clean seconds before the fault
    beats: dict | None = None  # every rank's newest report as the SIGSTOP faults were injected

    @property
    def expected(self) -> list[int]:
        if self.fault == "frozen-node":
            return [self.target * PER_NODE + i for i in range(PER_NODE)]
        return [self.target]

    @property
    def correct(self) -> bool:
        if self.verdict is None:
            return False
        if self.fault == "frozen-node":
            node = NODES[self.target]
            return self.verdict["culprits"] == self.expected and f"node {node}" in self.verdict["line"]
        nodes = {int(r): n for r, n in self.verdict["nodes"].items()}
        named = all(f"rank {r} on {nodes[r]}" in self.verdict["line"] for r in self.expected)
        return self.verdict["culprits"] == self.expected and named

    @property
    def detection_s(self) -> float:
        return self.verdict_at - self.injected_at


def _config(out: Path, min_s: float, checkpoint_every: int | None) -> Path:
    cfg: dict = {
        "name": "drill",
        "output_dir": str(out),
        "model": {"name": "debug", "dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "seq_len": 32},
        "parallelism": {"dp_shard": 2, "tp": 2},
        "train": {"steps": 1_000_000, "local_batch_size": 2, "log_every": 1, "tensorboard": False},
        "resilience": {"hang": {"min_s": min_s, "factor": 10, "start_s": 120}, "collective_timeout_s": 600},
    }
    if checkpoint_every:
        cfg["checkpoint"] = {"interval": checkpoint_every, "keep": 2, "dir": str(out / "ckpt")}
    path = out / "drill.json"
    path.write_text(json.dumps(cfg))
    return path


# libfaketime shifts both clocks of every process it is preloaded into (shared/notes/clock-skew.md).
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def skewed(seconds: float) -> dict[str, str]:
    """The environment that runs a node's agent and ranks with its clocks `seconds` ahead."""
    return {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"{seconds:+.0f}s", "FAKETIME_NO_CACHE": "1"}


def remove_faketime_leftovers(shm: Path = Path("/dev/shm")) -> int:
    """libfaketime (0.9.10, no switch to skip them) makes a shared memory file and a semaphore per process it is
    preloaded into, and removes them only at a normal exit: each drill's killed and stopped ranks leave theirs
    (263 pairs after a day of runs here). Removes those whose process is gone; returns how many files."""
    removed = 0
    for entry in shm.glob("*faketime_*"):
        prefix, _, pid = entry.name.rpartition("_")
        if prefix not in ("faketime_shm", "sem.faketime_sem") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (or another user's: not ours to remove)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed += 1
    return removed


@dataclass(frozen=True)
class Forked:
    """How the tests start a drill's agents and ranks: forked by a zygote (tests/integration/_torchrun), not cold.
    A forked process is no descendant of what started it: what stops a whole node finds the agent by `pid` and the
    ranks by the pids their reports give."""

    # A `sys.executable ...` command, given its node's environment (which it may add to), as started forked.
    command: Callable[[list[str], dict[str, str]], list[str]]
    # The process forked for a started command (the Popen; the monotonic time before it was started).
    pid: Callable[[subprocess.Popen, float], int]


@dataclass
class Agent:
    """A node's torchrun agent: what was started (the leader of its own process group), and the agent's own pid
    (the same, or the process forked for it)."""

    proc: subprocess.Popen
    pid: int


def launch(
    out: Path,
    min_s: float,
    env_extra: dict[str, str],
    checkpoint_every: int | None = None,
    node_env: dict[str, dict[str, str]] | None = None,
    forked: Forked | None = None,
) -> list[Agent]:
    """Start both agents (and, through them, the ranks), cold or `forked`.
    `node_env` adds variables to one node's agent and ranks (a skewed clock)."""
    out.mkdir(parents=True, exist_ok=True)
    clear_reports(out / "hangs")  # a killed earlier drill in this folder left its node-local reports
    config = _config(out, min_s, checkpoint_every)
    port = free_local_ports()
    agents = []
    for i, node in enumerate(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i)]
        cmd += ["--nproc-per-node", str(PER_NODE), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        env = run_env(out, SLURMD_NODENAME=node, **env_extra, **(node_env or {}).get(node, {}))
        rank = [sys.executable, "-m", "hpkit", "train", "--config", str(config)]
        if forked is None:
            cmd += rank[1:]
        else:
            cmd = forked.command([*cmd, "--no-python", "--", *forked.command(rank, env)], env)
        log = open(out / f"{node}.log", "w")  # noqa: SIM115 (closed with the process)
        since = time.monotonic()
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        agents.append(Agent(proc, proc.pid if forked is None else forked.pid(proc, since)))
    return agents


def beats(out: Path) -> dict[int, dict]:
    """Every rank's newest report, read from the node-local boards (all "nodes" share this host's /dev/shm)."""
    return reports_of(out / "hangs")


def _tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def stop_all(agents: list[Agent]) -> None:
    for agent in agents:
        for pid in dict.fromkeys([*_tree(agent.proc.pid), *_tree(agent.pid)]):
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
    for agent in agents:
        agent.proc.wait(timeout=30)


def _wait_verdict(out: Path, deadline: float) -> Path | None:
    while time.time() < deadline:
        found = list((out / "hangs").glob("*-step*/verdict.json"))
        if found:
            return found[0]
        time.sleep(0.05)
    return None


def run_trial(
    trial: Trial,
    out: Path,
    min_s: float,
    timeout_s: float = 240,
    node_env: dict[str, dict[str, str]] | None = None,
    clean_s: float = 0.0,
    forked: Forked | None = None,
) -> Trial:
    """One drill. `clean_s`: seconds of clean training, once every rank has reached the step before the fault,
    before a SIGSTOP fault is injected; `trial.clean_verdict` says whether a hang was called meanwhile."""
    fault_log = out / "faults.jsonl"
    env: dict[str, str] = {"HPKIT_FAULT_LOG": str(fault_log)}
    if trial.fault == "sleep":
        env["HPKIT_FAULT"] = f"hang:rank={trial.target},step={FAULT_STEP}"
    elif trial.fault == "skip":
        env["HPKIT_FAULT"] = f"skip:rank={trial.target},step={FAULT_STEP}"
    elif trial.fault == "sigstop-in-save":
        env["HPKIT_FAULT"] = f"slow_save:seconds={SAVE_HOLD_S},step={FAULT_STEP}"
    in_save = trial.fault == "sigstop-in-save"
    agents = launch(
        out,
        min_s,
        env,
        checkpoint_every=FAULT_STEP if in_save else None,
        node_env=node_env,
        forked=forked,
    )
    deadline = time.time() + timeout_s
    try:
        if in_save:
            # The event: every rank wrote its slow_save line, so every rank is inside the save of FAULT_STEP.
            while time.time() < deadline:
                lines = fault_log.read_text().splitlines() if fault_log.exists() else []
                if len({json.loads(line)["rank"] for line in lines}) == 2 * PER_NODE:
                    break
                time.sleep(0.05)
            else:
                raise TimeoutError("the ranks never reached the save")
            trial.injected_at = time.time()
            os.kill(beats(out)[trial.target]["pid"], signal.SIGSTOP)
        elif trial.fault in ("sleep", "skip"):
            while time.time() < deadline and not (fault_log.exists() and fault_log.read_text().strip()):
                time.sleep(0.05)
            trial.injected_at = json.loads(fault_log.read_text().splitlines()[0])["at"]
        else:
            # The event: every rank has finished FAULT_STEP - 1 steps (their reports say so) and has reported
            # 3 times, so that its node's summary listing it has reached the store (a node frozen before
            # that is named by its node, without the ranks it never announced).
            while time.time() < deadline:
                seen = beats(out)
                if (
                    len(seen) == 2 * PER_NODE
                    and min(b["step"] for b in seen.values()) >= FAULT_STEP - 1
                    and min(b["seq"] for b in seen.values()) >= 3
                ):
                    break
                time.sleep(0.05)
            else:
                raise TimeoutError("the ranks never reached the fault step")
            if clean_s:
                time.sleep(clean_s)
                # Any hang folder, or an agent gone, is a false alarm.
                trial.clean_verdict = any((out / "hangs").glob("*-step*")) or any(
                    a.proc.poll() is not None for a in agents
                )
                seen = beats(out)
            if trial.fault == "sigstop":
                pids = [seen[trial.target]["pid"]]
            else:
                # The agent and what it started (its client's too, where it was forked), and the node's ranks
                # wherever they were forked.
                agent = agents[trial.target]
                pids = list(
                    dict.fromkeys(
                        [
                            *_tree(agent.proc.pid),
                            *_tree(agent.pid),
                            *(seen[r]["pid"] for r in trial.expected),
                        ]
                    )
                )
            trial.injected_at, trial.beats = time.time(), seen
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
        found = _wait_verdict(out, deadline)
        if found is not None:
            trial.verdict_at = found.stat().st_mtime
            trial.verdict = json.loads(found.read_text())
    finally:
        stop_all(agents)
        trial.log = "".join((out / f"{n}.log").read_text(errors="replace") for n in NODES)
    return trial
