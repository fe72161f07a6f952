"""The hang watchdog: a thread in every rank that notices when no rank has finished a step for too long,
names the rank that holds the others up, and leaves every rank's stacks on disk.

Each rank's thread writes a heartbeat file once a second (`<hangs>/.beats/<attempt>/rank<r>.json`): its pid and node,
the last step it finished and when, what it is doing (a step, a checkpoint save, the first load), and how many
collectives it has entered (torch's per-group sequence numbers, summed: what the NCCL flight recorder compares).
Every rank reads every heartbeat (the output folder is shared, as checkpoints already need) and applies the
same rule, so they agree without a collective, which a hang would block:

- stalled: the newest step end of any rank is older than `max(min_s, factor x median step time)`; a rank in a
  checkpoint save or in the start-up load (first step included) holds the clock, since those are long by
  design;
- culprit: a rank whose own heartbeat stopped (a stopped process or a frozen node: its watchdog thread is
  frozen too) is named first; else the rank that has entered fewer collectives than the others (it never
  reached the one they wait in: a Python sleep, a deadlock, a dead NFS read); else no rank is singled out and
  the line names every candidate.

On a hang each rank writes its stacks (all threads, faulthandler, which needs nothing from a stuck main
thread) to `<hangs>/<attempt>-step<N>/rank<r>.txt`; a rank on the culprit's node sends a stopped culprit SIGCONT and
SIGUSR2 (faulthandler's registered dump) so that its stacks are written too; rank 0 writes `<hangs>/<attempt>-step<N>/
verdict.json` and prints the line; then every rank exits with HANG_EXIT, which the job script treats as a
restartable failure.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

HANG_EXIT = 75  # EX_TEMPFAIL: the job script restarts from the last checkpoint within max_restarts
BEAT_S = 1.0
# A heartbeat older than this is a frozen rank (its own thread stopped), not a busy one: 1 s beats, and
# room for a loaded node's scheduling and a slow shared file system.
STALE_BEAT_S = 5.0


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


@dataclass(frozen=True)
class Verdict:
    step: int
    stalled_s: float
    threshold_s: float
    culprits: list[int]
    reason: str  # "stopped", "behind", "unknown"
    nodes: dict[int, str]
    top_frames: dict[int, str]

    def line(self) -> str:
        where = ", ".join(f"rank {r} on {self.nodes.get(r, '?')}" for r in self.culprits)
        frame = self.top_frames.get(self.culprits[0], "") if len(self.culprits) == 1 else ""
        at = f" at {frame}" if frame else ""
        if self.reason == "stopped":
            why = "its heartbeat stopped (process stopped or node frozen)"
        elif self.reason == "behind":
            why = "it has not entered the collective the other ranks wait in"
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


def collectives_entered() -> int:
    """Collectives this process has issued, over every process group it belongs to."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return 0
        total = 0
        for group in list(dist.distributed_c10d._world.pg_map):
            try:
                total += int(group._get_sequence_number_for_group())
            except (RuntimeError, AttributeError):
                continue
        return total
    except Exception:  # the watchdog must never take the rank down itself
        return 0


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
    step = min(b.step for b in beats)
    stopped = sorted(b.rank for b in beats if now - b.beat_at >= STALE_BEAT_S)
    if stopped:
        culprits, reason = stopped, "stopped"
    else:
        least = min(b.collectives for b in beats)
        behind = sorted(b.rank for b in beats if b.collectives == least)
        if len(behind) < len(beats):
            culprits, reason = behind, "behind"
        else:
            culprits, reason = sorted(b.rank for b in beats), "unknown"
    return Verdict(step, stalled, threshold, culprits, reason, {b.rank: b.node for b in beats}, {})


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
        say: Any = print,
        exit_fn: Any = os._exit,
    ) -> None:
        self.folder = Path(folder)
        # One folder per attempt, so that a restarted job never reads the previous attempt's frozen beats.
        self.beats_dir = self.folder / ".beats" / attempt_id()
        self.rank, self.world = rank, world
        self.min_s, self.factor, self.start_s = min_s, factor, start_s
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._say, self._exit = say, exit_fn
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
        self._beat.collectives = collectives_entered()
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
        out = self.folder / f"{self.beats_dir.name}-step{verdict.step + 1}"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank{self.rank}.txt", "w", encoding="utf-8") as f:
            f.write(
                f"rank {self.rank} on {self.node}, pid {os.getpid()}\n{MAIN_THREAD}{main_thread_frame()}\n\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        beats = {b.rank: b for b in beats_read}
        for culprit in verdict.culprits:
            beat = beats.get(culprit)
            if verdict.reason == "stopped" and beat is not None and beat.node == self.node:
                self._dump_stopped(beat, out)
        self.verdict = verdict
        if self.rank == 0:
            time.sleep(2 * BEAT_S)  # the others' stack files land first
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
            (out / "verdict.json").write_text(
                json.dumps({**asdict(verdict), "line": verdict.line(), "stacks": str(out)}, indent=1),
                encoding="utf-8",
            )
            self._say(f"{verdict.line()}; stacks of every rank in {out}")
        else:
            time.sleep(3 * BEAT_S)
        self._exit(HANG_EXIT)

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
            (out / f"rank{beat.rank}.txt").write_text(source.read_text(encoding="utf-8", errors="replace"))
