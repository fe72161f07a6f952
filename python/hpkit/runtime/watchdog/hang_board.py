"""The node-local half of the hang watchdog's channel: each rank's report, on its own node only.

Every rank writes its report once a second to a small file in node-local memory (`/dev/shm`), never to the
shared filesystem; its node-mates read the folder, so a node's ranks see each other without any traffic
leaving the node. A report's age is read on the host's monotonic clock, which every process of the node shares
(the report says when it was written on it); a counter seen changing on the reader's own clock (`Freshness`) is
the fallback, and the only measure across nodes, whose clocks are never compared.

The folder is keyed by the run's hangs folder and the attempt, so two jobs (or two emulated nodes of one
test host) never share one: `<root>/hpkit-watch-<uid>/<run key>-<attempt>/<node>/rank<r>.json`, with
`<node>/verdict.json` the judge's word passed on by the node's leader.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpkit import json_text

BOARD_ENV = "HPKIT_WATCH_BOARD"  # another root for the boards (tests; hosts without /dev/shm)
# Boards left behind by killed jobs are removed by the next job's leader after this long.
LEFTOVER_S = 24 * 3600.0


def node_local_base(env: Mapping[str, str] | None, override: str) -> Path:
    """Where a node keeps what lives in its memory: the folder `override` names, else /dev/shm (tmpfs), else the
    temporary folder on hosts without it. The boards here and the in-memory checkpoints (memory_layout) use it."""
    env = os.environ if env is None else env
    if env.get(override):
        return Path(env[override])
    if os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm")
    return Path(tempfile.gettempdir())


def board_root(env: Mapping[str, str] | None = None) -> Path:
    return node_local_base(env, BOARD_ENV) / f"hpkit-watch-{os.getuid()}"


def run_key(hangs_dir: Path) -> str:
    """The same on every node of one run (the hangs folder is on the shared filesystem)."""
    return hashlib.sha1(str(Path(hangs_dir).resolve()).encode()).hexdigest()[:12]


def board_dir(hangs_dir: Path, attempt: str, env: dict[str, str] | None = None) -> Path:
    return board_root(env) / f"{run_key(hangs_dir)}-{attempt}"


def reports_of(hangs_dir: Path, env: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's latest report on this host, across the run's attempts (for tests and drills: on a real
    cluster each node sees only its own ranks)."""
    found: dict[int, dict[str, Any]] = {}
    # Oldest first, so that each rank's newest report wins: attempt names do not sort by time, and a killed
    # earlier run with the same key (a rerun test with the same folder and job id) leaves its reports behind.
    for path in sorted(board_root(env).glob(f"{run_key(hangs_dir)}-*/*/rank*.json"), key=_mtime):
        report = _read(path)
        if report is not None:
            found[int(report["rank"])] = report
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def clear_reports(hangs_dir: Path, env: dict[str, str] | None = None) -> None:
    """Remove this host's boards of a run (a drill about to reuse an output folder)."""
    for folder in board_root(env).glob(f"{run_key(hangs_dir)}-*"):
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json_text.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # being replaced: the next round reads it
    return data if isinstance(data, dict) else None


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class NodeBoard:
    """This rank's place on its node's board."""

    def __init__(self, folder: Path, node: str, rank: int) -> None:
        self.node_dir = Path(folder) / node
        self.own = self.node_dir / f"rank{rank}.json"
        self.verdict_file = self.node_dir / "verdict.json"

    def open(self, stale_before: float | None = None) -> NodeBoard:
        """Join the board; reports last written before `stale_before` (this host's wall clock, compared only with
        this host's file times) are a killed earlier run's with the same key, and are removed."""
        self.node_dir.mkdir(parents=True, exist_ok=True)
        if stale_before is not None:
            for path in [*self.node_dir.glob("rank*.json"), self.verdict_file]:
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < stale_before:
                        path.unlink()
        return self

    def write(self, report: dict[str, Any]) -> None:
        _write_whole(self.own, json.dumps(report, separators=(",", ":")))

    def read(self) -> dict[int, dict[str, Any]]:
        """rank -> report, for every rank of this node."""
        found = {}
        for path in self.node_dir.glob("rank*.json"):
            report = _read(path)
            if report is not None:
                found[int(report["rank"])] = report
        return found

    def post_verdict(self, verdict: dict[str, Any]) -> None:
        if not self.verdict_file.exists():
            _write_whole(self.verdict_file, json.dumps(verdict))

    def verdict(self) -> dict[str, Any] | None:
        return _read(self.verdict_file) if self.verdict_file.exists() else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.own.unlink()
        # The last rank out removes the node's and the attempt's folders (a non-empty one stays).
        for folder in (self.node_dir, self.node_dir.parent):
            with contextlib.suppress(OSError):
                for leftover in folder.glob("verdict.json"):
                    if not any(folder.glob("rank*.json")):
                        leftover.unlink()
                folder.rmdir()


def remove_leftovers(root: Path, keep: Path, older_than_s: float = LEFTOVER_S) -> None:
    """Boards of jobs that were killed before they could clean up (node-local memory is not freed by itself)."""
    cutoff = time.time() - older_than_s
    with contextlib.suppress(OSError):
        for folder in root.iterdir():
            with contextlib.suppress(OSError):
                if folder != keep and folder.stat().st_mtime < cutoff:
                    shutil.rmtree(folder, ignore_errors=True)


def pause(stop: Callable[[], bool], seconds: float, slice_s: float = 0.1) -> bool:
    """Sleep up to `seconds`, in slices, returning early (True) once `stop()` says so.

    Plain sleeps rather than Event.wait: a timed wait on a lock takes an absolute monotonic deadline, which a
    node whose clocks are shifted by libfaketime (the clock-skew drills) never reaches."""
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(slice_s, left))
    return True


class Freshness:
    """How long ago each key's counter was last seen changing, on this process's monotonic clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[Any, tuple[Any, float]] = {}

    def see(self, key: Any, counter: Any) -> float:
        """Record `counter` for `key`; returns the age of its last change (0 when it just changed)."""
        now = self._clock()
        last = self._seen.get(key)
        if last is None or last[0] != counter:
            self._seen[key] = (counter, now)
            return 0.0
        return now - last[1]

    def age(self, key: Any) -> float | None:
        last = self._seen.get(key)
        return None if last is None else self._clock() - last[1]
