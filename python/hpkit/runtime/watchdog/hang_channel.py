"""The cross-node half of the hang watchdog's channel: one summary per node a second, one judge.

Each node's leader (its lowest live rank) sends its node's summary to the watch store (`hpkit.watch_store`)
once a second, as one `compare_set` on its own key: the reply is the key's value, so the same call tells the
leader when the judge has overwritten every node's key with a verdict. One node's leader judges: it reads
every node's summary with one `multi_get` a second. Two standbys, next in line, read only the summaries of the
nodes before them and take over when all of those stopped changing (a frozen or cut-off judge). So the store
serves `nodes + 3` requests a second, and the shared filesystem none.

Line of judges: node 1, 2, ..., N-1, then node 0 (node 0 usually holds rank 0, which logs and checkpoints,
and under torchrun the store itself: its freezing is then found by the store's silence, not by a judge on it).

The judge reads ages only: a summary's age on its own monotonic clock (its counter seen changing) is added
to the ages inside it, which the node's leader measured the same way on its clock.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from hpkit.runtime.watchdog.hang_board import Freshness, pause
from hpkit.runtime.watchdog.hang_rules import STALE_S, NodeAggregate, RankView, Verdict, decide_nodes

STANDBYS = 2
VERDICT_MARK = "V"


class Store(Protocol):
    """The part of torch's c10d Store the channel uses (a counting wrapper stands in for it in the bench)."""

    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def set(self, key: str, value: str) -> None: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[str]) -> None: ...


def node_key(index: int) -> str:
    return f"n/{index}"


def judge_line(nodes: int) -> list[int]:
    """The order in which nodes judge: node 1 first, node 0 last."""
    return [*range(1, nodes), 0] if nodes > 1 else [0]


# A rank's entry in a node summary, compact: the judge reads thousands a second.
# [rank, pid, step, since_step_s, phase, age_s, median_step_s, collectives, groups, eval_rounds]
def summarize(
    node: str, index: int, seq: int, reports: dict[int, dict[str, Any]], ages: dict[int, float]
) -> str:
    """The node's summary, from its ranks' reports and their ages on the leader's clock."""
    ranks = []
    for rank, rep in sorted(reports.items()):
        age = ages.get(rank, 0.0)
        ranks.append(
            [
                rank,
                rep.get("pid", 0),
                rep.get("step", 0),
                round(float(rep.get("since_step_s", 0.0)) + age, 3),
                rep.get("phase", "step"),
                round(age, 3),
                rep.get("median_step_s"),
                rep.get("collectives", 0),
                _aged_groups(rep.get("groups") or {}, age),
                rep.get("eval_rounds", 0),
            ]
        )
    # A header line the judge reads every second, the node's aggregate, which it reads once the job may be
    # stalled, then the ranks, which it reads only for the nodes that matter then (a node with a late or
    # stopped rank; every node when the live ranks' collectives are compared): parsing 16k ranks costs the
    # judge's rank more than a 100 ms budget.
    newest = min((entry[3] for entry in ranks), default=0.0)
    header = {"node": node, "index": index, "seq": seq, "newest_step_s": newest}
    phases: dict[str, float] = {}
    for entry in ranks:
        phases[entry[4]] = min(phases.get(entry[4], entry[3]), entry[3])
    aggregate = {
        "ranks": [entry[0] for entry in ranks],
        "medians": [entry[6] for entry in ranks if entry[6]],
        "oldest_age_s": max((entry[5] for entry in ranks), default=0.0),
        "least_step": min((entry[2] for entry in ranks), default=0),
        "phases": phases,
        "eval_rounds": max((entry[9] for entry in ranks), default=0),
    }
    return "\n".join(json.dumps(part, separators=(",", ":")) for part in (header, aggregate, ranks))


# Parses one JSON value from a position and says where it ended: a summary's lines are read one at a time,
# without splitting the text (json.loads adds a copy and a whitespace scan per call, thousands a second).
_decode = json.JSONDecoder().raw_decode


def parse_summary(text: str, ranks: bool = True) -> dict[str, Any]:
    """A node summary: its header, and its ranks (`ranks` False: the header alone, which is cheap)."""
    summary, end = _decode(text)
    if ranks:
        end = _decode(text, end + 1)[1] if end < len(text) else end
        summary["ranks"] = _decode(text, end + 1)[0] if end < len(text) else []
    return summary


def node_aggregate(header: dict[str, Any], text: str, summary_age: float) -> NodeAggregate:
    """The aggregate in a node summary (`header`: its header, parsed) as the judge sees it, `summary_age` after
    the leader sent it."""
    agg = _decode(text, text.index("\n") + 1)[0]
    return NodeAggregate(
        node=str(header["node"]),
        ranks=agg["ranks"],
        medians=agg["medians"],
        oldest_age_s=float(agg["oldest_age_s"]) + summary_age,
        newest_step_s=float(header["newest_step_s"]) + summary_age,
        least_step=int(agg["least_step"]),
        phases={phase: float(since) + summary_age for phase, since in agg["phases"].items()},
        eval_rounds=int(agg["eval_rounds"]),
    )


def _aged_groups(groups: dict[str, list[Any]], age: float) -> dict[str, list[Any]]:
    return {
        name: [entered, op, round(float(op_age) + age, 3)] for name, (entered, op, op_age) in groups.items()
    }


def views(summary: dict[str, Any], summary_age: float) -> list[RankView]:
    """The ranks of one node summary as the judge sees them, `summary_age` after the leader sent it."""
    out = []
    for rank, pid, step, since, phase, age, median, collectives, groups, eval_rounds in summary["ranks"]:
        out.append(
            RankView(
                rank=int(rank),
                node=str(summary["node"]),
                pid=int(pid),
                step=int(step),
                since_step_s=float(since) + summary_age,
                phase=str(phase),
                age_s=float(age) + summary_age,
                median_step_s=median,
                collectives=int(collectives),
                groups=groups or {},
                groups_age_s=summary_age,
                eval_rounds=int(eval_rounds),
            )
        )
    return out


class Judge:
    """Reads every node's summary and decides; keeps each node's counter to age it on this clock."""

    def __init__(
        self, nodes: int, world: int, min_s: float, factor: float, start_s: float, clock: Callable[[], float]
    ) -> None:
        self.nodes, self.world = nodes, world
        self.min_s, self.factor, self.start_s = min_s, factor, start_s
        self.fresh = Freshness(clock)  # node index -> its summary counter; shared with the standby's watch
        self._all_seen = False
        self.last_decision_s = 0.0

    def round(self, store: Store) -> Verdict | None:
        keys = [node_key(i) for i in range(self.nodes)]
        if not self._all_seen:
            # multi_get waits for missing keys: read only once every node has sent its first summary.
            if not store.check(keys):
                return None
            self._all_seen = True
        raw = store.multi_get(keys)
        started = time.perf_counter()
        texts, headers, ages, newest = [], [], [], float("inf")
        for value in raw:
            text = value.decode() if isinstance(value, bytes) else str(value)
            if text.startswith(VERDICT_MARK):
                return None  # a verdict is already out (another judge's)
            header = parse_summary(text, ranks=False)
            age = self.fresh.see(header["index"], header["seq"])
            texts.append(text)
            headers.append(header)
            ages.append(age)
            newest = min(newest, float(header.get("newest_step_s", 0.0)) + age)
        verdict = None
        # Some rank finished a step within min_s (the smallest limit there is): not stalled, whatever the rest.
        if newest >= self.min_s:
            unpacked: dict[int, list[RankView]] = {}

            def unpack(i: int) -> list[RankView]:
                if i not in unpacked:
                    unpacked[i] = views(parse_summary(texts[i]), ages[i])
                return unpacked[i]

            nodes = [node_aggregate(*parts) for parts in zip(headers, texts, ages, strict=True)]
            verdict = decide_nodes(nodes, unpack, self.min_s, self.factor, self.world, self.start_s)
        self.last_decision_s = time.perf_counter() - started
        return verdict


def announce(store: Store, nodes: int, record: dict[str, Any]) -> None:
    """Tell every node's leader: its next compare_set reads this instead of its own summary."""
    text = VERDICT_MARK + json.dumps(record, separators=(",", ":"))
    store.set("verdict", text)
    store.multi_set([node_key(i) for i in range(nodes)], [text] * nodes)


class Uplink:
    """A node leader's link to the store, on its own thread: a store call may block for as long as the store's
    host is frozen, and the rank's reports on its board must go on meanwhile.

    `offer` hands it the node's newest summary; `silent_s` says how long the store has not answered;
    `verdict` is the judge's record once one came back (or this node judged one)."""

    def __init__(
        self,
        connect: Callable[[], Store],
        index: int,
        nodes: int,
        judge: Judge,
        on_verdict: Callable[[Verdict], dict[str, Any]],
        clock: Callable[[], float] = time.monotonic,
        beat_s: float = 1.0,
    ) -> None:
        self._connect, self.index, self.nodes = connect, index, nodes
        self._judge, self._on_verdict, self._clock, self._beat_s = judge, on_verdict, clock, beat_s
        line = judge_line(nodes)
        self.position = line.index(index) if index in line else len(line)
        self._before = line[: self.position]  # the judges ahead of this node
        self.judging = self.position == 0
        # The standby ages the judges ahead on the judge's own clock: taking over, it already knows how long the
        # judge's node has been silent (a fresh start would give that node STALE_S more).
        self._ahead = judge.fresh
        self._ahead_seen = False
        self._offered: str | None = None
        self._sent: str | None = None
        self._started = clock()
        self.last_ok: float | None = None
        self.verdict: dict[str, Any] | None = None
        self.first_summary: dict[str, Any] | None = None  # node 0's, read once (the fallback store's node)
        self._want_first = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, want_first_summary: bool = False) -> Uplink:
        self._want_first = want_first_summary
        self._thread = threading.Thread(target=self._run, name="hpkit-hang-uplink", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def offer(self, summary: str) -> None:
        self._offered = summary

    def silent_s(self) -> float:
        return self._clock() - (self.last_ok if self.last_ok is not None else self._started)

    def restart_silence(self) -> None:
        """Count the store's silence from now (this process itself was stopped meanwhile)."""
        self._started = self._clock()
        if self.last_ok is not None:
            self.last_ok = self._started

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception:  # the store cannot be reached: silent_s grows, the board thread judges that
            return
        while not self._stop.is_set() and self.verdict is None:
            stepped = self._offered
            # A store error is a silent store (silent_s grows); never take the rank down.
            with contextlib.suppress(Exception):
                self.step(store)
            # Sent as soon as the board thread offers the next summary: a timer of its own would add up to a
            # second between a rank's report and the judge.
            pause(lambda sent=stepped: self._stop.is_set() or self._offered is not sent, 2 * self._beat_s)

    def step(self, store: Store) -> None:
        """One round: send the summary, watch the judges ahead, judge if it is this node's turn."""
        summary = self._offered
        if summary is None:
            return
        key = node_key(self.index)
        if self._sent is None:
            current = store.get(key).decode() if store.check([key]) else None
            if current is not None and current.startswith(VERDICT_MARK):
                self._got_verdict(current)
                return
            if current is None:
                store.set(key, summary)
                reply = summary
            else:
                reply = store.compare_set(key, current, summary).decode()
        else:
            reply = store.compare_set(key, self._sent, summary).decode()
        self.last_ok = self._clock()
        if reply.startswith(VERDICT_MARK):
            self._got_verdict(reply)
            return
        # Another leader of this node (a hand-over in progress) may have written since: follow its value.
        self._sent = reply
        if self._want_first and self._first_incomplete() and store.check([node_key(0)]):
            first = store.get(node_key(0)).decode()
            if not first.startswith(VERDICT_MARK):
                self.first_summary = parse_summary(first)
        if not self.judging and 0 < self.position <= STANDBYS:
            self.judging = self._judges_ahead_stopped(store)
        if self.judging:
            verdict = self._judge.round(store)
            if verdict is not None:
                record = self._on_verdict(verdict)
                announce(store, self.nodes, record)
                self.verdict = record

    def _first_incomplete(self) -> bool:
        """Node 0's summary is read until it lists all its ranks (its first ones may come before its last)."""
        per_node = self._judge.world // max(1, self.nodes)
        return self.first_summary is None or len(self.first_summary.get("ranks", [])) < per_node

    def _judges_ahead_stopped(self, store: Store) -> bool:
        keys = [node_key(i) for i in self._before]
        if not self._ahead_seen:
            if not store.check(keys):
                return False
            self._ahead_seen = True
        for i, value in zip(self._before, store.multi_get(keys), strict=True):
            text = value.decode() if isinstance(value, bytes) else str(value)
            if text.startswith(VERDICT_MARK):
                return False
            if self._ahead.see(i, parse_summary(text, ranks=False)["seq"]) < STALE_S:
                return False
        return True

    def _got_verdict(self, text: str) -> None:
        self.verdict = json.loads(text[len(VERDICT_MARK) :])
