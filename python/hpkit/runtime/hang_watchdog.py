"""The hang watchdog: a thread in every rank that notices when no rank has finished a step for too long,
names the rank that holds the others up, and leaves every rank's stacks on disk.

Each rank's thread writes a heartbeat file once a second (`<hangs>/.beats/<attempt>/rank<r>.json`): its pid and node,
the last step it finished and when, what it is doing (a step, a checkpoint save, the first load), and, for every
process group it belongs to, how many collectives it has entered there (torch's per-group sequence number) with
the newest one's op and start time, read from torch's flight recorder (`TORCH_FR_BUFFER_SIZE`; it records gloo
collectives as well as NCCL's). Every rank reads every heartbeat (the output folder is shared, as checkpoints
already need) and applies the same rule, so they agree without a collective, which a hang would block:

- stalled: the newest step end of any rank is older than `max(min_s, factor x median step time)`; a rank in a
  checkpoint save or in the start-up load (first step included) holds the clock, since those are long by
  design; no verdict while some heartbeat is between fresh and stale (2-5 s old: the rank may be freezing);
- culprit, compared per process group as the flight recorder's analyser does:
  - stopped: a rank whose own heartbeat stopped (a stopped process, a frozen node: its watchdog thread is
    frozen too) is named first, and a node all of whose ranks stopped is named as a frozen node;
  - behind: in each group, a member that has entered more collectives waits for the members that entered
    fewer; the ranks that others wait for and that wait for nobody never reached the collective (a Python
    sleep, a deadlock, a dead NFS read);
  - skipped: waits that run in a circle (rank A waits in group G for B, B waits in group H for A) come from a
    rank that left a collective out and went on to the next: the rank the most others wait for, then the one
    with the most steps finished (the skip let it finish its step), then the one behind in the wait that
    began first;
  - mismatch: members at the same count whose newest collectives differ (an all-reduce against an
    all-gather): the minority is named;
  - else no rank is singled out and the line names every candidate.

On a hang each rank writes its stacks (all threads, faulthandler, which needs nothing from a stuck main thread)
and its flight-recorder trace to `<hangs>/<attempt>-step<N>/rank<r>.txt` and `fr-rank<r>.json`; a rank on the
culprit's node sends a stopped culprit SIGCONT and SIGUSR2 (faulthandler's registered dump) so that its stacks
are written too; the first live rank to claim the folder (an atomic mkdir: rank 0 may be the frozen one) writes
`culprit_nodes` and `verdict.json` and prints the line; then every rank exits with HANG_EXIT, which the job
script treats as a restartable failure.

torch 2.13's `torch.distributed.debug.start_debug_server()` serves the same stacks and flight-recorder data over
HTTP from each rank, on request: it needs a live process to answer (a stopped or frozen rank cannot), and
someone to ask. This watchdog asks nobody: it decides from heartbeat files and writes what it found.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

HANG_EXIT = 75  # EX_TEMPFAIL: the job script restarts from the last checkpoint within max_restarts
BEAT_S = 1.0
# A heartbeat older than this is a frozen rank (its own thread stopped), not a busy one: 1 s beats, and
# room for a loaded node's scheduling and a slow shared file system.
STALE_BEAT_S = 5.0
# A heartbeat this old may belong to a rank that is freezing: wait until it is fresh again or stale.
LATE_BEAT_S = 2.0
# Without a finished step for this long a rank reads its flight recorder into each heartbeat.
SUSPECT_S = 2.0
# torch's flight recorder keeps this many collectives per rank (ring buffer) unless the user set it.
FR_BUFFER_SIZE = "2000"


@dataclass
class Beat:
    rank: int
    node: str
    pid: int
    step: int  # last step finished
    step_end: float  # wall time it finished (or the watchdog started)
    phase: str  # "start", "step", "save"
    collectives: int
    beat_at: float
    median_step_s: float | None = None
    # process group name -> [members (global ranks), collectives entered, newest op, its start (Unix s)]
    groups: dict[str, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    step: int
    stalled_s: float
    threshold_s: float
    culprits: list[int]
    reason: str  # "stopped", "behind", "skipped", "mismatch", "unknown"
    nodes: dict[int, str]
    top_frames: dict[int, str]
    group: str = ""  # the process group the culprit holds up, where one was compared

    def frozen_nodes(self) -> list[str]:
        """Nodes every rank of which stopped beating."""
        culprits = set(self.culprits) if self.reason == "stopped" else set()
        nodes = sorted({self.nodes[r] for r in culprits if r in self.nodes})
        return [n for n in nodes if all(r in culprits for r, node in self.nodes.items() if node == n)]

    def line(self) -> str:
        where = ", ".join(f"rank {r} on {self.nodes.get(r, '?')}" for r in self.culprits)
        frame = self.top_frames.get(self.culprits[0], "") if len(self.culprits) == 1 else ""
        at = f" at {frame}" if frame else ""
        group = f" (process group {self.group})" if self.group else ""
        if self.reason == "stopped":
            frozen = self.frozen_nodes()
            if frozen:
                why = f"node {', '.join(frozen)} froze: every rank on it stopped beating"
            else:
                why = "its heartbeat stopped (process stopped or node frozen)"
        elif self.reason == "behind":
            why = f"it has not entered the collective the other ranks wait in{group}"
        elif self.reason == "skipped":
            why = f"it left out a collective the other ranks wait in{group} and went on to the next"
        elif self.reason == "mismatch":
            why = f"its collective differs from the one the other ranks are in{group}"
        else:
            return (
                f"hpkit: hang: no rank finished step {self.step + 1} for {self.stalled_s:.0f} s "
                f"(limit {self.threshold_s:.0f} s); the culprit cannot be told, candidates: {where}"
            )
        return (
            f"hpkit: hang: {where} held up step {self.step + 1} for {self.stalled_s:.0f} s "
            f"(limit {self.threshold_s:.0f} s): {why}{at}"
        )


def attempt_id(env: dict[str, str] | None = None) -> str:
    """The same on every rank of one attempt, different across requeues, restarts and elastic restarts."""
    env = dict(os.environ if env is None else env)
    parts = [
        env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local",
        env.get("SLURM_RESTART_COUNT") or "0",
        env.get("HPKIT_STEP_ATTEMPT") or "0",
        env.get("TORCHELASTIC_RESTART_COUNT") or "0",
    ]
    return "-".join(p.replace("/", "_") for p in parts)


def enable_flight_recorder(env: dict[str, str] | None = None) -> None:
    """Turn torch's flight recorder on (before the process groups are made) unless the user chose a size."""
    env = os.environ if env is None else env
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER_SIZE


def flight_recorder_json() -> str:
    """This process's flight-recorder trace (JSON), or "" where torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = _dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        return trace.decode() if isinstance(trace, bytes) else str(trace)
    except Exception:  # no recorder in this build, or none enabled: the counts alone still compare
        return ""


def newest_ops(trace: str) -> dict[str, tuple[str, float]]:
    """Process group name -> (op, start in Unix s) of the newest collective in a flight-recorder trace."""
    newest: dict[str, tuple[int, str, float]] = {}
    try:
        entries = json.loads(trace).get("entries", []) if trace else []
    except ValueError:
        return {}
    for e in entries:
        seq = int(e.get("collective_seq_id") or 0)
        pg = e.get("process_group") or [""]
        if not seq or not pg:
            continue  # point-to-point ops carry no collective sequence number
        name = str(pg[0])
        if name not in newest or seq >= newest[name][0]:
            newest[name] = (seq, str(e.get("profiling_name", "")), int(e.get("time_created_ns", 0)) / 1e9)
    return {name: (op, at) for name, (_, op, at) in newest.items()}


_MEMBERS: dict[str, list[int]] = {}


def group_collectives(with_ops: bool) -> dict[str, list[Any]]:
    """For every process group of this process: [members, collectives entered, newest op, its start]."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        world = dist.distributed_c10d._world
        ops = newest_ops(flight_recorder_json()) if with_ops else {}
        out: dict[str, list[Any]] = {}
        for pg in list(world.pg_map):
            name = world.pg_names.get(pg)
            if name is None:
                continue
            try:
                entered = int(pg._get_sequence_number_for_group())
                if name not in _MEMBERS:
                    _MEMBERS[name] = list(dist.get_process_group_ranks(pg))
            except (RuntimeError, AttributeError, ValueError):
                continue
            op, at = ops.get(name, ("", 0.0))
            out[name] = [_MEMBERS[name], entered, op, at]
        return out
    except Exception:  # the watchdog must never take the rank down itself
        return {}


def decide(
    beats: list[Beat], now: float, min_s: float, factor: float, world: int, start_s: float = 600.0
) -> Verdict | None:
    """The shared rule: a verdict when the job is stalled, else None. Pure, so every rank agrees."""
    if len(beats) < world:
        return None  # not every rank has started its watchdog yet: nothing to compare
    live = [b for b in beats if now - b.beat_at < STALE_BEAT_S]
    if any(b.phase == "save" for b in live):
        return None  # a checkpoint save is long by design (and ends in a collective the others wait in)
    if any(b.phase == "start" and now - b.step_end < start_s for b in live):
        return None  # the start-up load and first step: allowed start_s
    medians = [b.median_step_s for b in beats if b.median_step_s]
    threshold = max(min_s, factor * statistics.median(medians)) if medians else min_s
    newest = max(b.step_end for b in beats)
    stalled = now - newest
    if stalled < threshold:
        return None
    if any(LATE_BEAT_S <= now - b.beat_at < STALE_BEAT_S for b in beats):
        return None  # a rank may be freezing right now: judge once its beat is fresh again or stale
    step = min(b.step for b in beats)
    nodes = {b.rank: b.node for b in beats}
    stopped = sorted(b.rank for b in beats if now - b.beat_at >= STALE_BEAT_S)
    if stopped:
        return Verdict(step, stalled, threshold, stopped, "stopped", nodes, {})
    culprits, reason, group = blame(beats)
    return Verdict(step, stalled, threshold, culprits, reason, nodes, {}, group)


def blame(beats: list[Beat]) -> tuple[list[int], str, str]:
    """Which live ranks hold the others up, from the collectives each entered per process group."""
    everyone = sorted(b.rank for b in beats)
    if not any(b.groups for b in beats):
        # Heartbeats without per-group counts: compare the totals.
        least = min(b.collectives for b in beats)
        behind = sorted(b.rank for b in beats if b.collectives == least)
        return (behind, "behind", "") if len(behind) < len(beats) else (everyone, "unknown", "")
    # group -> rank -> (entered, op, start), for the members that reported it
    groups: dict[str, dict[int, tuple[int, str, float]]] = {}
    for b in beats:
        for name, (members, entered, op, at) in b.groups.items():
            if b.rank in members:
                groups.setdefault(name, {})[b.rank] = (int(entered), str(op), float(at))
    waits_for: dict[int, set[int]] = {}
    pending: list[tuple[float, str, list[int]]] = []  # (when the wait started, group, who is waited for)
    for name, seen in sorted(groups.items()):
        if len(seen) < 2:
            continue
        low = min(e for e, _, _ in seen.values())
        behind = sorted(r for r, (e, _, _) in seen.items() if e == low)
        ahead = [r for r, (e, _, _) in seen.items() if e > low]
        for r in ahead:
            waits_for.setdefault(r, set()).update(behind)
        if ahead:
            pending.append((min(seen[r][2] for r in ahead), name, behind))
    if waits_for:
        waited = set().union(*waits_for.values())
        sinks = sorted(waited - set(waits_for))
        if sinks:
            group = next((g for _, g, behind in sorted(pending) if set(behind) & set(sinks)), "")
            return sinks, "behind", group
        # A circle: one rank left a collective out and went on to the next, where it waits for a peer that
        # waits in the left-out one. The skipper is waited for by the most ranks (everyone else in the group
        # it skipped in), has finished the most steps (the skip let it finish its step), and, last, is
        # behind in the wait that began first (not always: a fast skipper may reach its next collective
        # before the slowest peer reached the skipped one).
        step = {b.rank: b.step for b in beats}
        waiters: dict[int, set[int]] = {}
        for r, targets in waits_for.items():
            for t in targets:
                waiters.setdefault(t, set()).add(r)
        first_wait = {}
        for at, name, behind in sorted(pending, reverse=True):
            for r in behind:
                first_wait[r] = (at, name)
        score = {r: (len(waiters[r]), step.get(r, 0), -first_wait[r][0]) for r in waiters}
        best = max(score.values())
        culprits = sorted(r for r, sc in score.items() if sc == best)
        return culprits, "skipped", first_wait[culprits[0]][1]
    for name, seen in sorted(groups.items()):
        ops = Counter(op for _, op, _ in seen.values() if op)
        if len(ops) < 2:
            continue
        counts = sorted(ops.values())
        if counts[0] < counts[1]:
            odd = min(ops, key=lambda op: ops[op])
            return sorted(r for r, (_, op, _) in seen.items() if op == odd), "mismatch", name
        return sorted(seen), "unknown", name
    return everyone, "unknown", ""


def _write_whole(path: Path, text: str) -> None:
    """Write through a temporary name, so that a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def top_frame(stacks: str) -> str:
    """The innermost frame of the main thread in a stack file: `file:line in function`."""
    for line in stacks.splitlines():
        if line.startswith(MAIN_THREAD):
            return line.removeprefix(MAIN_THREAD).strip()
    # A dump faulthandler wrote from a signal (a stopped rank): the main thread is the one whose stack does
    # not start in threading.py (every other thread's does), whichever thread ran the handler.
    for block in stacks.split("\n\n"):
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if frames and "threading.py" not in frames[-1] and "hang_watchdog" not in frames[0]:
            return _frame(frames[0])
    return ""


def _frame(line: str) -> str:
    return line.removeprefix("File ").replace('", line ', ":").replace('"', "")


MAIN_THREAD = "main thread at: "


def main_thread_frame() -> str:
    """Where this process's main thread is now (read from the watchdog thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class HangWatchdog:
    """Start it once the process group is up; call `step_done` after each step and `phase` around saves."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        world: int,
        min_s: float,
        factor: float,
        start_s: float = 600.0,
        say: Any = None,
        exit_fn: Any = os._exit,
    ) -> None:
        self.folder = Path(folder)
        # One folder per attempt, so that a restarted job never reads the previous attempt's frozen beats.
        self.beats_dir = self.folder / ".beats" / attempt_id()
        self.rank, self.world = rank, world
        self.min_s, self.factor, self.start_s = min_s, factor, start_s
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        # The line is printed by whichever rank writes the verdict, not only rank 0 (which may be frozen).
        # On stderr: job scripts show only local rank 0's stdout, and the writer may be any rank.
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._exit = exit_fn
        now = time.time()
        self._beat = Beat(rank, self.node, os.getpid(), 0, now, "start", 0, now)
        self._durations: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dump_file: TextIO | None = None
        self.verdict: Verdict | None = None

    # Called by the training loop: plain attribute writes, no lock, no I/O.
    def step_done(self, step: int, step_time_s: float) -> None:
        self._durations.append(step_time_s)
        del self._durations[:-50]
        self._beat.median_step_s = statistics.median(self._durations) if len(self._durations) >= 3 else None
        self._beat.step, self._beat.step_end, self._beat.phase = step, time.time(), "step"

    def phase(self, name: str) -> None:
        self._beat.phase = name
        if name == "step":
            self._beat.step_end = time.time()  # a save or the start-up load just ended: the clock restarts

    def start(self) -> HangWatchdog:
        self.beats_dir.mkdir(parents=True, exist_ok=True)
        # A stopped culprit cannot dump itself: its node-mates continue it and send SIGUSR2, which
        # faulthandler answers in C into this file (opened now, while this rank is healthy).
        stacks = self.folder / ".stacks"
        stacks.mkdir(parents=True, exist_ok=True)
        self._dump_file = open(stacks / f"rank{self.rank}.txt", "w", encoding="utf-8")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR2, file=self._dump_file, all_threads=True, chain=False)
        self._thread = threading.Thread(target=self._run, name="hpkit-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        faulthandler.unregister(signal.SIGUSR2)
        if self._dump_file is not None:
            self._dump_file.close()

    # The thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._write_beat()
                beats = self._read_beats()
                verdict = decide(beats, time.time(), self.min_s, self.factor, self.world, self.start_s)
            except Exception as exc:  # never take the rank down for the watchdog's own trouble
                print(f"hpkit: hang watchdog: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            if verdict is not None:
                self._on_hang(verdict, beats)
                return

    def _write_beat(self) -> None:
        now = time.time()
        # The flight recorder is read only once this rank has gone a while without finishing a step: a
        # running job pays for the counts alone.
        suspect = now - self._beat.step_end > min(SUSPECT_S, self.min_s / 2)
        self._beat.groups = group_collectives(with_ops=suspect)
        self._beat.collectives = sum(int(g[1]) for g in self._beat.groups.values())
        self._beat.beat_at = time.time()
        path = self.beats_dir / f"rank{self.rank}.json"
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self._beat)), encoding="utf-8")
        os.replace(tmp, path)

    def _read_beats(self) -> list[Beat]:
        beats = []
        for path in self.beats_dir.glob("rank*.json"):
            try:
                beats.append(Beat(**json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError):
                continue  # being replaced: the next round reads it
        return beats

    def _on_hang(self, verdict: Verdict, beats_read: list[Beat]) -> None:
        # Claimed at once, before the slow part: a stopped culprit that a node-mate continues (below) wakes
        # up and judges too, from its own view, and must not be the one whose verdict is written.
        writer = self._claim()
        out = self.folder / f"{self.beats_dir.name}-step{verdict.step + 1}"
        out.mkdir(parents=True, exist_ok=True)
        # The flight-recorder trace first, the stacks last, each whole when it appears: the verdict's
        # writer waits for every live rank's stack file.
        trace = flight_recorder_json()
        if trace:
            _write_whole(out / f"fr-rank{self.rank}.json", trace)
        stacks = out / f".rank{self.rank}.txt.{os.getpid()}.tmp"
        with open(stacks, "w", encoding="utf-8") as f:
            f.write(
                f"rank {self.rank} on {self.node}, pid {os.getpid()}\n{MAIN_THREAD}{main_thread_frame()}\n\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(stacks, out / f"rank{self.rank}.txt")
        beats = {b.rank: b for b in beats_read}
        for culprit in verdict.culprits:
            beat = beats.get(culprit)
            if verdict.reason == "stopped" and beat is not None and beat.node == self.node:
                self._dump_stopped(beat, out)
        self.verdict = verdict
        if writer:
            # The others' stack files land first: every rank that still beats writes its own at once.
            live = {r for r in verdict.nodes if not (verdict.reason == "stopped" and r in verdict.culprits)}
            deadline = time.time() + 2 * BEAT_S
            while time.time() < deadline and not all((out / f"rank{r}.txt").exists() for r in live):
                time.sleep(0.05)
            frames = {}
            for r in verdict.culprits:
                path = out / f"rank{r}.txt"
                if path.exists():
                    frames[r] = top_frame(path.read_text(encoding="utf-8", errors="replace"))
            verdict = Verdict(**{**asdict(verdict), "top_frames": frames})
            # For the job script (plain shell, no JSON) to leave the culprits' nodes out of the next
            # step when it has spares; written first, since verdict.json's appearance is the signal.
            culprit_nodes = sorted({verdict.nodes[r] for r in verdict.culprits if r in verdict.nodes})
            (out / "culprit_nodes").write_text("".join(f"{n}\n" for n in culprit_nodes), encoding="utf-8")
            missing = sorted(set(verdict.nodes) - {int(p.stem[4:]) for p in out.glob("rank*.txt")})
            record = {**asdict(verdict), "line": verdict.line(), "stacks": str(out), "no_stacks": missing}
            _write_whole(out / "verdict.json", json.dumps(record, indent=1))
            self._say(f"{verdict.line()}; stacks of every rank in {out}")
        else:
            time.sleep(3 * BEAT_S)
        self._exit(HANG_EXIT)

    def _claim(self) -> bool:
        """True for the one rank of this attempt that writes the verdict: the first live one to judge."""
        claims = self.folder / ".writers"
        claims.mkdir(parents=True, exist_ok=True)
        try:
            (claims / self.beats_dir.name).mkdir()
        except FileExistsError:
            return False
        (claims / self.beats_dir.name / f"rank{self.rank}").touch()
        return True

    def _dump_stopped(self, beat: Beat, out: Path) -> None:
        """A stopped rank on this node: continue it just long enough to dump its stacks into its file."""
        source = self.folder / ".stacks" / f"rank{beat.rank}.txt"
        try:
            os.kill(beat.pid, signal.SIGCONT)
            os.kill(beat.pid, signal.SIGUSR2)
        except ProcessLookupError:
            return
        deadline = time.time() + 3
        while time.time() < deadline and not (source.exists() and source.stat().st_size):
            time.sleep(0.1)
        if source.exists() and source.stat().st_size:
            _write_whole(out / f"rank{beat.rank}.txt", source.read_text(encoding="utf-8", errors="replace"))
