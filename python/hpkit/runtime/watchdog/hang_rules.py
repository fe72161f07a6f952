"""The hang watchdog's rule: when a job is stalled, and which rank or node holds it up. Pure and torch-free.

Every figure is an age in seconds, measured on one clock at a time and added up along the way a report
travelled (the rank's own clock, then its node leader's, then the judge's): no wall-clock time from one host is
ever compared with another host's, so nodes whose clocks disagree by minutes are judged the same.

- stalled: no rank has finished a step for `max(min_s, factor x median step time)`; a live rank in a checkpoint
  save or in the start-up load (first step included) holds the clock, since those are long by design; a live
  rank in a validation holds it for as long as the validation's own length allows (`eval_limit_s`); no
  verdict while some rank's report is between fresh and stale (`LATE_S`..`STALE_S` old: it may be freezing);
  a rank silent for the whole limit is judged whatever the phase (the others wait for it in the save);
  ranks are compared once every rank has reported, but a rank that reported and stopped is named before that;
- culprit, compared per process group as the flight recorder's analyser does:
  - stopped: a rank whose reports stopped (a stopped process, a frozen or cut-off node) is named first, and a
    node all of whose ranks stopped is named as a node;
  - behind: in each group, a member that has entered more collectives waits for the members that entered
    fewer; the ranks that others wait for and that wait for nobody never reached the collective;
  - skipped: waits that run in a circle come from a rank that left a collective out and went on to the next:
    the rank the most others wait for, then the one with the most steps finished, then the one behind in the
    wait that began first (the oldest newest-collective);
  - mismatch: members at the same count whose newest collectives differ: the minority is named;
  - else no rank is singled out and the line names every candidate.
- store: a node that has not reached the watchdog's store for a while, while its own ranks finish no step,
  names the store's node (frozen, or cut off), or itself (its own link is down): see `store_verdict`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpkit.job_events import CULPRIT_UNKNOWN, hang_culprits, hang_text

# A report older than this is a stopped rank or node (its watchdog thread stopped too), not a busy one:
# one report a second, and room for a loaded host's scheduling.
STALE_S = 5.0
# A report this old may come from a rank that is freezing now: judge once it is fresh again or stale.
LATE_S = 2.0


@dataclass
class RankView:
    """One rank as the judge sees it now."""

    rank: int
    node: str
    pid: int
    step: int  # steps finished
    since_step_s: float  # since its last step ended (or its watchdog started)
    phase: str  # "start", "step", "save", "eval"
    age_s: float  # since its report was last seen changing
    median_step_s: float | None = None
    collectives: int = 0
    # process group name -> [collectives entered, newest op, how long ago that op started, as of the report]
    groups: dict[str, list[Any]] = field(default_factory=dict)
    # Seconds to add to each op's age: how old the report is (kept apart so that a judge reading thousands of
    # ranks does not rebuild every rank's groups)
    groups_age_s: float = 0.0
    eval_rounds: int = 0  # the batches this rank runs in a validation (0: no validation)

    @property
    def live(self) -> bool:
        return self.age_s < STALE_S


@dataclass(frozen=True)
class Verdict:
    step: int
    stalled_s: float
    threshold_s: float
    culprits: list[int]
    reason: str  # "stopped", "behind", "skipped", "mismatch", "unknown", "store"
    nodes: dict[int, str]
    top_frames: dict[int, str]
    group: str = ""  # the process group the culprit holds up, where one was compared
    # reason "store": the store's address and node, and the node that could not reach it
    store: str = ""
    store_node: str = ""
    reporter: str = ""

    def frozen_nodes(self) -> list[str]:
        """Nodes every rank of which stopped reporting."""
        culprits = set(self.culprits) if self.reason == "stopped" else set()
        nodes = sorted({self.nodes[r] for r in culprits if r in self.nodes})
        return [n for n in nodes if all(r in culprits for r, node in self.nodes.items() if node == n)]

    def culprit_nodes(self) -> list[str]:
        """The nodes to leave out of the next step (a spare takes their place)."""
        if self.reason == "store":
            return [self.store_node] if self.store_node else []
        return sorted({self.nodes[r] for r in self.culprits if r in self.nodes})

    def line(self) -> str:
        if self.reason == "store":
            where = f"node {self.store_node} ({self.store})" if self.store_node else self.store
            return hang_text(
                f"the watchdog's store on {where} has not answered node {self.reporter} for "
                f"{self.stalled_s:.0f} s while no step finished (limit {self.threshold_s:.0f} s): "
                f"{self.store_node or 'its node'} froze or is cut off, or {self.reporter}'s own link is down"
            )
        where = hang_culprits((r, self.nodes.get(r, "?")) for r in self.culprits)
        frame = self.top_frames.get(self.culprits[0], "") if len(self.culprits) == 1 else ""
        at = f" at {frame}" if frame else ""
        group = f" (process group {self.group})" if self.group else ""
        if self.reason == "stopped":
            frozen = self.frozen_nodes()
            if frozen:
                why = f"node {', '.join(frozen)} froze or is cut off: every rank on it stopped reporting"
            else:
                why = "its heartbeat stopped (process stopped or node frozen)"
        elif self.reason == "behind":
            why = f"it has not entered the collective the other ranks wait in{group}"
        elif self.reason == "skipped":
            why = f"it left out a collective the other ranks wait in{group} and went on to the next"
        elif self.reason == "mismatch":
            why = f"its collective differs from the one the other ranks are in{group}"
        else:
            return hang_text(
                f"no rank finished step {self.step + 1} for {self.stalled_s:.0f} s "
                f"(limit {self.threshold_s:.0f} s); {CULPRIT_UNKNOWN}, candidates: {where}"
            )
        return hang_text(
            f"{where} held up step {self.step + 1} for {self.stalled_s:.0f} s "
            f"(limit {self.threshold_s:.0f} s): {why}{at}"
        )


def threshold_s(medians: list[float], min_s: float, factor: float) -> float:
    return max(min_s, factor * statistics.median(medians)) if medians else min_s


def eval_limit_s(medians: list[float], min_s: float, factor: float, start_s: float, rounds: int) -> float:
    """How long a validation of `rounds` batches may take: as long as that many steps are allowed (each batch is
    one forward, less than a step's forward and backward), or start_s before any step time is known."""
    if not medians:
        return start_s
    return max(min_s, factor * statistics.median(medians) * max(1, rounds))


@dataclass
class NodeAggregate:
    """One node's ranks in a few figures, enough to decide whether the job is stalled and which nodes to look
    into: a judge reading thousands of ranks unpacks the per-rank views only of the nodes where a rank may be
    late or stopped, or of every node when the live ranks must be compared."""

    node: str
    ranks: list[int]
    medians: list[float]  # the ranks' median step times that are known (a threshold is a median of them all)
    oldest_age_s: float  # the oldest report's age
    newest_step_s: float  # since_step_s of the rank that finished a step last
    least_step: int  # the fewest steps a rank finished
    phases: dict[str, float] = field(default_factory=dict)  # phase -> the least since_step_s of its ranks
    eval_rounds: int = 0  # the most batches a rank of it runs in a validation

    def fresh(self) -> bool:
        """Every rank's report is fresh: none is late or stopped, so its views add nothing but their count."""
        return self.oldest_age_s < LATE_S


def aggregate(views: list[RankView]) -> NodeAggregate:
    """The aggregate of one node's views (the judge gets it ready-made in each node's summary)."""
    phases: dict[str, float] = {}
    for v in views:
        phases[v.phase] = min(phases.get(v.phase, v.since_step_s), v.since_step_s)
    return NodeAggregate(
        node=views[0].node if views else "",
        ranks=[v.rank for v in views],
        medians=[v.median_step_s for v in views if v.median_step_s],
        oldest_age_s=max((v.age_s for v in views), default=0.0),
        newest_step_s=min((v.since_step_s for v in views), default=float("inf")),
        least_step=min((v.step for v in views), default=0),
        phases=phases,
        eval_rounds=max((v.eval_rounds for v in views), default=0),
    )


def decide(
    views: list[RankView], min_s: float, factor: float, world: int, start_s: float = 600.0
) -> Verdict | None:
    """A verdict when the job is stalled, else None."""
    by_node: dict[str, list[RankView]] = {}
    for v in views:
        by_node.setdefault(v.node, []).append(v)
    groups = list(by_node.values())
    return decide_nodes([aggregate(g) for g in groups], groups.__getitem__, min_s, factor, world, start_s)


def decide_nodes(
    nodes: list[NodeAggregate],
    unpack: Callable[[int], list[RankView]],
    min_s: float,
    factor: float,
    world: int,
    start_s: float = 600.0,
) -> Verdict | None:
    """`decide` from the nodes' aggregates, calling `unpack(i)` for node i's views only where they matter: the
    nodes that may hold a late or stopped rank once the job looks stalled, and every node when the live ranks'
    collectives are compared. The verdict is the one `decide` gives on every view."""
    medians = [m for n in nodes for m in n.medians]
    limit = threshold_s(medians, min_s, factor)
    # Not every rank has reported yet (a node's first summary may precede its last ranks' first reports): nothing
    # to compare, but a rank that reported and then stopped is named all the same.
    complete = sum(len(n.ranks) for n in nodes) >= world
    oldest = max((n.oldest_age_s for n in nodes), default=0.0)
    if not complete and oldest < STALE_S:
        return None
    stalled = min((n.newest_step_s for n in nodes), default=float("inf"))
    if stalled < limit:
        return None  # the running job's round: decided from the aggregates alone
    fresh = [n for n in nodes if n.fresh()]
    looked = [v for i, n in enumerate(nodes) if not n.fresh() for v in unpack(i)]
    if any(LATE_S <= v.age_s < STALE_S for v in looked):
        return None  # a rank may be freezing right now: judge once its report is fresh again or stale
    live = [v for v in looked if v.live]  # and every rank of a fresh node
    # Only the live ranks' phases count: a rank that stopped inside a save would otherwise hold the clock
    # for ever (it is the culprit, not a reason to wait). And none counts once a rank has been silent for the
    # whole limit: its live peers wait for it in the save's (or the first step's) collectives, still saying
    # "save", and would hold the clock until the collective timeout ended the job with no one named.
    if oldest < limit:
        if any("save" in n.phases for n in fresh) or any(v.phase == "save" for v in live):
            return None  # a checkpoint save is long by design (and ends in a collective the others wait in)
        if any(n.phases.get("start", start_s) < start_s for n in fresh) or any(
            v.phase == "start" and v.since_step_s < start_s for v in live
        ):
            return None  # the start-up load and first step: allowed start_s
        allowed = eval_limit_s(medians, min_s, factor, start_s, max(n.eval_rounds for n in nodes))
        if any(n.phases.get("eval", allowed) < allowed for n in fresh) or any(
            v.phase == "eval" and v.since_step_s < allowed for v in live
        ):
            return None  # a validation: allowed its own length, then judged (a rank stuck in it is named)
    # The step the live ranks are held in: a stopped rank's last report may be many steps old (its node's first
    # summary, sent before step 1, for a rank that stopped within a second).
    held = [n.least_step for n in fresh] + [v.step for v in live]
    step = min(held) if held else min(v.step for v in looked)
    where = {r: n.node for n in nodes for r in n.ranks}
    stopped = sorted(v.rank for v in looked if not v.live)
    if stopped:
        return Verdict(step, stalled, limit, stopped, "stopped", where, {})
    if not complete:
        return None
    culprits, reason, group = blame([v for i in range(len(nodes)) for v in unpack(i)])
    return Verdict(step, stalled, limit, culprits, reason, where, {}, group)


def blame(views: list[RankView]) -> tuple[list[int], str, str]:
    """Which live ranks hold the others up, from the collectives each entered per process group."""
    everyone = sorted(v.rank for v in views)
    if not any(v.groups for v in views):
        # Reports without per-group counts: compare the totals.
        least = min(v.collectives for v in views)
        behind = sorted(v.rank for v in views if v.collectives == least)
        return (behind, "behind", "") if len(behind) < len(views) else (everyone, "unknown", "")
    # group -> rank -> (entered, op, how long ago the op started)
    groups: dict[str, dict[int, tuple[int, str, float]]] = {}
    for v in views:
        for name, (entered, op, age) in v.groups.items():
            groups.setdefault(name, {})[v.rank] = (int(entered), str(op), float(age) + v.groups_age_s)
    waits_for: dict[int, set[int]] = {}
    # (minus how long ago the wait started: the smallest began first, group, who is waited for)
    pending: list[tuple[float, str, list[int]]] = []
    for name, seen in sorted(groups.items()):
        if len(seen) < 2:
            continue
        low = min(e for e, _, _ in seen.values())
        behind = sorted(r for r, (e, _, _) in seen.items() if e == low)
        ahead = [r for r, (e, _, _) in seen.items() if e > low]
        for r in ahead:
            waits_for.setdefault(r, set()).update(behind)
        if ahead:
            pending.append((-max(seen[r][2] for r in ahead), name, behind))
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
        step = {v.rank: v.step for v in views}
        waiters: dict[int, set[int]] = {}
        for r, targets in waits_for.items():
            for t in targets:
                waiters.setdefault(t, set()).add(r)
        first_wait = {}
        for began, name, behind in sorted(pending, reverse=True):
            for r in behind:
                first_wait[r] = (began, name)
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


def store_verdict(
    *,
    silent_s: float,
    local_stalled_s: float,
    local_threshold_s: float,
    grace_s: float,
    step: int,
    store: str,
    store_node: str,
    reporter: str,
    store_ranks: dict[int, str],
) -> Verdict | None:
    """A node that cannot reach the watchdog's store judges alone, and only once both its store has been silent
    and its own ranks have finished no step for the limit plus `grace_s`: a live judge names a cut-off node
    within the limit, so it speaks first (one verdict per attempt), and a store that is merely slow while
    training goes on raises nothing."""
    wait = local_threshold_s + grace_s
    if silent_s < wait or local_stalled_s < wait:
        return None
    return Verdict(
        step,
        local_stalled_s,
        local_threshold_s,
        sorted(store_ranks),
        "store",
        dict(store_ranks),
        {},
        store=store,
        store_node=store_node,
        reporter=reporter,
    )
