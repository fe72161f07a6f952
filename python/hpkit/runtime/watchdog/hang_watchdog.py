"""The hang watchdog: a thread in every rank that notices when no rank has finished a step for too long, names
the rank or node that holds the others up, and leaves every rank's stacks on disk.

Its steady-state cost grows with no shared resource as the job grows:
- each rank writes a small report once a second to its node's board in node-local memory
  (`hang_board`: its last step and how long ago, its phase, per process group the collectives it entered and,
  once it has gone a while without a step, the newest one's op and age, from torch's flight recorder);
- each node's leader (its lowest live rank) sends one summary of its ranks a second to the watch store,
  the c10d store the job already runs outside the training processes (`hang_channel`, `hpkit.watch_store`);
  its first before the first step, so that a node that stops at once is still judged;
- one node's leader judges every node's summary with the rule in `hang_rules`; two standbys take over from
  a judge that stops; the judge's verdict comes back to every leader in the reply to its next summary;
- nothing is written under the output folder (the shared filesystem) until a hang is called;
- ages within a node are read on the host's monotonic clock, which its processes share; across nodes, an age is a
  counter seen changing on the reader's own monotonic clock: nodes' clocks are never compared.

On a hang each rank writes its stacks (all threads, faulthandler, which needs nothing from a stuck main thread)
and its flight-recorder trace to `<hangs>/<attempt>-step<N>/rank<r>.txt` and `fr-rank<r>.json`; a node's leader
sends a stopped culprit on its node SIGCONT and SIGUSR2 (faulthandler's registered dump) so that its stacks are
written too; the verdict's writer (the judge, or a node that found the store silent) claims the folder with an
atomic mkdir, writes `culprit_nodes` and `verdict.json` and prints the line; then every rank exits with
HANG_EXIT, which the job's supervisor treats as a restartable failure.

torch 2.13's `torch.distributed.debug.start_debug_server()` serves the same stacks and flight-recorder data over
HTTP from each rank, on request: it needs a live process to answer (a stopped or frozen rank cannot), and
someone to ask. This watchdog asks nobody: it decides from the reports and writes what it found.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from hpkit.job_events import (
    CULPRIT_NODES,
    HANG_EXIT,
    VERDICT,
    VERDICT_JUDGE,
    hang_attempt,
    hang_folder,
    hang_line,
    job_key,
)
from hpkit.runtime.env import node_name
from hpkit.runtime.watchdog.hang_board import (
    Freshness,
    NodeBoard,
    board_dir,
    board_root,
    pause,
    remove_leftovers,
)
from hpkit.runtime.watchdog.hang_channel import Judge, Store, Uplink, summarize
from hpkit.runtime.watchdog.hang_rules import LATE_S, STALE_S, Verdict, store_verdict, threshold_s
from hpkit.watch_store import KEY_PREFIX, StoreAddress, address_from_env

BEAT_S = 1.0
# Without a finished step for this long a rank reads its flight recorder into each report.
SUSPECT_S = 2.0
# torch's flight recorder keeps this many collectives per rank (ring buffer) unless the user set it.
FR_BUFFER_SIZE = "2000"
# A node that cannot reach the store judges alone only this long after the limit: a live judge names a
# cut-off node within the limit and speaks first.
STORE_GRACE_S = STALE_S
# How long a store call may take before the client gives up (a frozen host may hold it longer: the uplink
# runs on its own thread for that reason).
STORE_TIMEOUT_S = 10.0


def attempt_id(env: dict[str, str] | None = None) -> str:
    """The same on every rank of one attempt, different across requeues, restarts and elastic restarts."""
    env = dict(os.environ if env is None else env)
    return hang_attempt(
        job_key(env) or env.get("TORCHELASTIC_RUN_ID") or "local",  # JOB_TASK in a job array
        env.get("SLURM_RESTART_COUNT") or "0",
        env.get("HPKIT_STEP_ATTEMPT") or "0",
        env.get("TORCHELASTIC_RESTART_COUNT") or "0",
    )


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


def _write_whole(path: Path, text: str) -> None:
    """Write through a temporary name, so that a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def settled_text(path: Path, within_s: float, quiet_s: float = 0.3, poll_s: float = 0.1) -> str | None:
    """The file's text once it has stopped growing (the same non-zero size for `quiet_s`), or None if it has not
    within `within_s`. A stopped rank's stacks are written by faulthandler from a signal, in many writes and with no
    mark at the end: a file read as soon as it is not empty can be half a dump (its main thread missing), which a
    loaded machine makes likely."""
    deadline = time.monotonic() + within_s
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now_size = path.stat().st_size if path.exists() else 0
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif size and time.monotonic() - since >= quiet_s:
            return path.read_text(encoding="utf-8", errors="replace")
        time.sleep(poll_s)
    return path.read_text(encoding="utf-8", errors="replace") if size > 0 and path.exists() else None


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


def group_collectives(with_ops: bool) -> dict[str, list[Any]]:
    """For every process group of this process: [collectives entered, newest op, how long ago it started]."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        world = dist.distributed_c10d._world
        ops = newest_ops(flight_recorder_json()) if with_ops else {}
        now = time.time()  # the flight recorder's times are this host's wall clock: compared here only
        out: dict[str, list[Any]] = {}
        for pg in list(world.pg_map):
            name = world.pg_names.get(pg)
            if name is None:
                continue
            try:
                entered = int(pg._get_sequence_number_for_group())
            except (RuntimeError, AttributeError, ValueError):
                continue
            op, at = ops.get(name, ("", 0.0))
            out[name] = [entered, op, round(max(0.0, now - at), 3) if at else 0.0]
        return out
    except Exception:  # the watchdog must never take the rank down itself
        return {}


def node_place(rank: int, world: int, env: Mapping[str, str]) -> tuple[int, int]:
    """(this rank's node index, number of nodes), the same on every rank of a node."""
    if env.get("GROUP_RANK", "").isdigit() and env.get("GROUP_WORLD_SIZE", "").isdigit():
        return int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"])  # torchrun
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or ""
    if env.get("SLURM_NODEID", "").isdigit() and nodes.isdigit():
        return int(env["SLURM_NODEID"]), int(nodes)  # srun, one task per GPU
    per_node = env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or ""
    if per_node.isdigit() and int(per_node) > 0:
        return rank // int(per_node), math.ceil(world / int(per_node))
    return rank, world  # nothing says which ranks share a node: each is its own


class MemoryStore:
    """A store inside this process, for a job on one node: nothing crosses a node, so nothing is sent."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    def get(self, key: str) -> bytes:
        return self._data[key]

    def set(self, key: str, value: str) -> None:
        self._data[key] = value.encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self._lock:
            if self._data.get(key, b"") == expected.encode():
                self._data[key] = desired.encode()
            return self._data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._data[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        for k, v in zip(keys, values, strict=True):
            self._data[k] = v.encode()


def connect_store(address: StoreAddress, attempt: str) -> Store:
    from torch.distributed import PrefixStore, TCPStore

    client = TCPStore(address.host, address.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return PrefixStore(f"{KEY_PREFIX}/{attempt}", client)  # type: ignore[return-value]


def verdict_record(verdict: Verdict) -> dict[str, Any]:
    return {**asdict(verdict), "line": verdict.line()}


def verdict_from(record: Mapping[str, Any]) -> Verdict:
    fields = {k: record[k] for k in Verdict.__dataclass_fields__ if k in record}
    fields["nodes"] = {int(r): n for r, n in fields.get("nodes", {}).items()}
    fields["top_frames"] = {int(r): f for r, f in fields.get("top_frames", {}).items()}
    return Verdict(**fields)


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
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        self.folder = Path(folder)
        # One board per attempt, so that a restarted job never reads the previous attempt's frozen reports.
        self.attempt = attempt_id(dict(env))
        self.rank, self.world = rank, world
        self.min_s, self.factor, self.start_s = min_s, factor, start_s
        self.node = node_name(env)  # Slurm's name: an OCI container's host name is the container's own
        self.index, self.nodes = node_place(rank, world, env)
        self.address = address_from_env(env) if self.nodes > 1 else None
        self.board = NodeBoard(board_dir(self.folder, self.attempt, dict(env)), self.node, rank)
        # The line is printed by whichever rank writes the verdict, not only rank 0 (which may be frozen).
        # On stderr: job scripts show only local rank 0's stdout, and the writer may be any rank.
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._exit = exit_fn
        self._seq = 0
        self._summaries = 0  # the node summaries this rank sent while it led its node
        self._step = 0
        self._step_end = time.monotonic()
        self._phase = "start"
        self.eval_rounds = 0  # this rank's batches in a validation: the length a validation is judged by
        self._durations: list[float] = []
        self._median: float | None = None
        self._fresh = Freshness()
        self._uplink: Uplink | None = None
        self._memory_store = MemoryStore()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dump_file: TextIO | None = None
        self._reports: dict[int, dict[str, Any]] = {}
        self.verdict: Verdict | None = None

    # Called by the training loop: plain attribute writes, no lock, no I/O.
    def step_done(self, step: int, step_time_s: float) -> None:
        self._durations.append(step_time_s)
        del self._durations[:-50]
        self._median = statistics.median(self._durations) if len(self._durations) >= 3 else None
        self._step, self._step_end, self._phase = step, time.monotonic(), "step"

    def phase(self, name: str) -> None:
        self._phase = name
        if name == "step":
            self._step_end = time.monotonic()  # a save or the start-up load just ended: the clock restarts

    def start(self) -> HangWatchdog:
        # Every rank of a live run rewrites its report each second; one untouched since well before this rank
        # started was left by a killed run with the same key (a bare torchrun's run id is "none").
        self.board.open(stale_before=time.time() - 2 * STALE_S)
        remove_leftovers(board_root(), self.board.node_dir.parent)
        # A stopped culprit cannot dump itself: its node's leader continues it and sends SIGUSR2, which
        # faulthandler answers in C into this node-local file (opened now, while this rank is healthy).
        self._dump_file = open(self.board.node_dir / f"stacks-rank{self.rank}.txt", "w", encoding="utf-8")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR2, file=self._dump_file, all_threads=True, chain=False)
        self._first_beat()
        self._thread = threading.Thread(target=self._run, name="hpkit-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def _first_beat(self) -> None:
        """Report now, and if this rank leads its node, wait (up to STORE_TIMEOUT_S) until the node's first summary
        is in the store, before the first step. A node whose ranks stopped before their first summary reached the
        store was never judged: the judge waits for every node's first summary (multi_get blocks on a missing key),
        and its standbys for the judge's; a 24-step run on a busy host stopped within the first second so."""
        try:
            self._round()
        except Exception as exc:  # never take the rank down for the watchdog's own trouble
            print(f"hpkit: hang watchdog: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return
        uplink = self._uplink
        if uplink is not None:
            pause(lambda: uplink.last_ok is not None or not uplink.alive(), STORE_TIMEOUT_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            pause(lambda: not self._thread.is_alive(), 5)  # not join(timeout): see hang_board.pause
        if self._uplink is not None:
            self._uplink.stop()
        faulthandler.unregister(signal.SIGUSR2)
        if self._dump_file is not None:
            self._dump_file.close()
            with contextlib.suppress(OSError):
                Path(self._dump_file.name).unlink()
        self.board.close()

    # The thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        last = time.monotonic()
        while not pause(self._stop.is_set, BEAT_S):
            now = time.monotonic()
            if now - last > STALE_S and self._uplink is not None:
                # This process was stopped (SIGSTOP, a frozen host) and runs again: the store's silence it measured
                # was its own. Judged on it, it would blame the store's node (seen when slurmstepd continued a
                # stopped rank to end its step).
                self._uplink.restart_silence()
            last = now
            try:
                record, writer = self._round()
            except Exception as exc:  # never take the rank down for the watchdog's own trouble
                print(f"hpkit: hang watchdog: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            if record is not None:
                self._on_hang(record, writer)
                return

    def report(self) -> dict[str, Any]:
        """This rank's report for its node's board."""
        since = time.monotonic() - self._step_end
        # The flight recorder is read only once this rank has gone a while without finishing a step: a
        # running job pays for the counts alone.
        groups = group_collectives(with_ops=since > min(SUSPECT_S, self.min_s / 2))
        self._seq += 1
        return {
            "rank": self.rank,
            "node": self.node,
            "pid": os.getpid(),
            "seq": self._seq,
            "at": time.monotonic(),  # read only by the ranks of this host (one monotonic clock)
            "step": self._step,
            "since_step_s": round(time.monotonic() - self._step_end, 3),
            "phase": self._phase,
            "eval_rounds": self.eval_rounds,
            "median_step_s": self._median,
            "collectives": sum(int(g[0]) for g in groups.values()),
            # The ops and their ages matter only once a rank is suspect: leave them out before.
            "groups": groups if since > SUSPECT_S else {},
        }

    def _round(self) -> tuple[dict[str, Any] | None, bool]:
        """One beat: report, read the node, lead it if this rank is its lowest live one. Returns a verdict
        record once there is one, and whether this rank writes it."""
        self.board.write(self.report())
        reports = self.board.read()
        self._reports = reports
        now = time.monotonic()
        ages = {r: 0.0 if r == self.rank else self._age(r, rep, now) for r, rep in reports.items()}
        posted = self.board.verdict()
        if posted is not None:
            return posted, False
        uplink = self._uplink
        if uplink is not None and uplink.verdict is not None:
            return uplink.verdict, self.verdict is not None  # set by _judged when this rank judged it
        # A leader that is late hands over at LATE_S, well before the judge calls its node stale (STALE_S).
        leader = min(r for r, age in ages.items() if age < LATE_S)
        if leader != self.rank:
            if uplink is not None:
                uplink.stop()
                self._uplink = None
            return None, False
        if uplink is None:
            uplink = self._uplink = self._new_uplink()
        self._summaries += 1
        uplink.offer(summarize(self.node, self.index, self._summaries, reports, ages))
        record = self._store_silence(uplink, reports, ages)
        return (record, True) if record is not None else (None, False)

    def _age(self, rank: int, report: dict[str, Any], now: float) -> float:
        """How old a node-mate's report is. Processes of one host share its monotonic clock, so the time the
        report says it was written is exact; the counter seen changing (up to a beat late) is the fallback
        where that time cannot be read on this clock (another time namespace)."""
        counted = self._fresh.see(rank, report.get("seq"))
        at = report.get("at")
        if isinstance(at, (int, float)) and 0.0 <= now - at <= counted + 2 * BEAT_S:
            return now - at
        return counted

    def _new_uplink(self) -> Uplink:
        judge = Judge(self.nodes, self.world, self.min_s, self.factor, self.start_s, time.monotonic)
        address, attempt = self.address, self.attempt

        def connect() -> Store:
            if address is None:
                return self._memory_store
            return connect_store(address, attempt)

        uplink = Uplink(connect, self.index, self.nodes, judge, self._judged)
        # The fallback store is node 0's (torchrun's agent, or rank 0 under srun): learn its ranks once.
        return uplink.start(want_first_summary=address is not None and not address.node)

    def _judged(self, verdict: Verdict) -> dict[str, Any]:
        self.verdict = verdict
        return verdict_record(verdict)

    def _store_silence(
        self, uplink: Uplink, reports: dict[int, dict[str, Any]], ages: dict[int, float]
    ) -> dict[str, Any] | None:
        """This node's own verdict when the store stopped answering while its ranks finish no step."""
        if self.address is None:
            return None
        local = [r for r, age in ages.items() if age < STALE_S]
        if any(reports[r].get("phase") in ("save", "start") for r in local):
            return None
        stalled = min(float(reports[r].get("since_step_s", 0.0)) + ages[r] for r in reports)
        limit = threshold_s(
            [m for r in reports if (m := reports[r].get("median_step_s"))], self.min_s, self.factor
        )
        first = uplink.first_summary or {}
        store_node = self.address.node or str(first.get("node", ""))
        store_ranks = (
            {int(r[0]): str(first["node"]) for r in first.get("ranks", [])}
            if first.get("node") == store_node
            else {}
        )
        if store_ranks and not self.address.node:
            # The fallback store is node 0's, whose ranks are 0..per_node-1 (torchrun and srun's block
            # placement); its summary may predate its last ranks' first reports.
            store_ranks.update(dict.fromkeys(range(self.world // max(1, self.nodes)), store_node))
        verdict = store_verdict(
            silent_s=uplink.silent_s(),
            local_stalled_s=stalled,
            local_threshold_s=limit,
            grace_s=STORE_GRACE_S,
            step=min(int(rep.get("step", 0)) for rep in reports.values()),
            store=f"{self.address.host}:{self.address.port}",
            store_node=store_node,
            reporter=self.node,
            store_ranks=store_ranks,
        )
        if verdict is None:
            return None
        self.verdict = verdict
        return verdict_record(verdict)

    def _on_hang(self, record: dict[str, Any], writer: bool) -> None:
        verdict = verdict_from(record)
        # Claimed at once, before the slow part: only one verdict per attempt reaches the disk.
        writer = writer and self._claim()
        leader = self._uplink is not None
        if leader:
            self.board.post_verdict(record)  # the node's other ranks read it on their next beat
        out = hang_folder(self.folder, self.attempt, verdict.step + 1)
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
        if leader and verdict.reason == "stopped":
            for culprit in verdict.culprits:
                report = self._reports.get(culprit)
                if report is not None and culprit != self.rank:
                    self._dump_stopped(culprit, int(report.get("pid", 0)), out)
        if writer:
            self._write_verdict(verdict, out)
        else:
            time.sleep(4 * BEAT_S)  # the writer may be waiting for this rank's stacks; let it finish
        self._exit(HANG_EXIT)

    def _write_verdict(self, verdict: Verdict, out: Path) -> None:
        # The others' stack files land first: every rank that still reports writes its own at once.
        gone = set(verdict.culprits) if verdict.reason in ("stopped", "store") else set()
        # Every rank the verdict knows and this node's own (a store verdict knows only the store's node).
        live = {r for r in {*verdict.nodes, *self._reports} if r not in gone}
        deadline = time.monotonic() + 2 * BEAT_S
        while time.monotonic() < deadline and not all((out / f"rank{r}.txt").exists() for r in live):
            time.sleep(0.05)
        frames = {}
        for r in verdict.culprits:
            path = out / f"rank{r}.txt"
            if path.exists():
                frames[r] = top_frame(path.read_text(encoding="utf-8", errors="replace"))
        verdict = Verdict(**{**asdict(verdict), "top_frames": frames})
        # For the supervisor, to leave the culprits' nodes out of the next step when it has spares; written
        # first, since verdict.json's appearance is the signal.
        (out / CULPRIT_NODES).write_text("".join(f"{n}\n" for n in verdict.culprit_nodes()), encoding="utf-8")
        missing = sorted(set(verdict.nodes) - {int(p.stem[4:]) for p in out.glob("rank*.txt")})
        record = {
            **verdict_record(verdict),
            "stacks": str(out),
            "no_stacks": missing,
            VERDICT_JUDGE: self.node,
        }
        _write_whole(out / VERDICT, json.dumps(record, indent=1))
        self._say(hang_line(verdict.line(), out))

    def _claim(self) -> bool:
        """True for the one process of this attempt that writes the verdict."""
        claims = self.folder / ".writers"
        claims.mkdir(parents=True, exist_ok=True)
        try:
            (claims / self.attempt).mkdir()
        except FileExistsError:
            return False
        (claims / self.attempt / f"rank{self.rank}").touch()
        return True

    def _dump_stopped(self, rank: int, pid: int, out: Path) -> None:
        """A stopped rank on this node: continue it just long enough to dump its stacks into its file."""
        source = self.board.node_dir / f"stacks-rank{rank}.txt"
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGUSR2)
        except (ProcessLookupError, PermissionError):
            return
        text = settled_text(source, within_s=3)
        if text:
            _write_whole(out / f"rank{rank}.txt", text)
