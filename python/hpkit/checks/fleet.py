"""Many nodes' check reports side by side: which nodes failed what, whose facts differ from the rest,
whose links are slow, and which nodes to leave out of the next job.

Pure functions over the JSON that `hpkit check --json` prints on each node; gathering it is
hpkit.commands.check_nodes's job.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpkit import json_text
from hpkit.slurm.hostlist import natural_key

STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
DEFAULT_BANDWIDTH_FRACTION = 0.5


@dataclass(frozen=True)
class NodeReport:
    """One node's answer: its checks' verdicts and facts, or why there is none."""

    node: str
    statuses: Mapping[str, str] = field(default_factory=dict)
    details: Mapping[str, str] = field(default_factory=dict)
    fixes: Mapping[str, str] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_node_report(text: str, fallback_node: str) -> NodeReport:
    """A node's `hpkit check --json` output; a report with `error` set when it is not one."""
    text = text.strip()
    if not text:
        return NodeReport(fallback_node, error="no output from the check (see its .err file)")
    try:
        data = json_text.loads(text)
        checks = data["checks"]
    except (ValueError, KeyError, TypeError) as exc:
        first = text.splitlines()[0][:120]
        return NodeReport(fallback_node, error=f"unreadable check output ({exc.__class__.__name__}): {first}")
    facts: dict[str, Any] = {}
    for row in checks:
        facts.update(row.get("facts") or {})
    return NodeReport(
        node=str(data.get("node") or fallback_node),
        statuses={row["name"]: row["status"] for row in checks},
        details={row["name"]: row.get("detail", "") for row in checks},
        fixes={row["name"]: row.get("fix", "") for row in checks},
        facts=facts,
    )


@dataclass(frozen=True)
class CheckRow:
    name: str
    nodes: Mapping[str, tuple[str, ...]]  # status -> nodes, each sorted


@dataclass(frozen=True)
class FactSpread:
    """A fact that is not the same on every node: the most common value and the nodes that differ."""

    name: str
    majority: Any
    majority_nodes: tuple[str, ...]
    differ: Mapping[str, Any]  # node -> its value
    split: bool  # no value is held by more nodes than every other: the odd ones cannot be told


@dataclass(frozen=True)
class Bandwidth:
    busbw_gbps: Mapping[str, float | None]  # node -> its best pair's busbw; None: never measured
    median_gbps: float | None
    fraction: float
    slow: tuple[str, ...]


@dataclass(frozen=True)
class FleetReport:
    nodes: tuple[str, ...]
    rows: tuple[CheckRow, ...]
    facts: tuple[FactSpread, ...]
    cluster_wide: tuple[str, ...]  # checks that failed on every node that answered
    node_failures: Mapping[str, tuple[str, ...]]  # node -> checks that failed there but not everywhere
    no_result: Mapping[str, str]  # node -> why it gave no report
    bandwidth: Bandwidth | None
    exclude: tuple[str, ...]
    reports: Mapping[str, NodeReport]

    @property
    def ok(self) -> bool:
        unmeasured = self.bandwidth is not None and self.bandwidth.median_gbps is None
        return not (self.exclude or self.cluster_wide or unmeasured or any(f.split for f in self.facts))

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "nodes": list(self.nodes),
            "exclude": list(self.exclude),
            "exclude_option": exclude_option(self.exclude),
            "checks": {row.name: {s: list(row.nodes.get(s, ())) for s in STATUSES} for row in self.rows},
            "facts_differ": {
                f.name: {
                    "majority": f.majority,
                    "majority_nodes": list(f.majority_nodes),
                    "differ": dict(f.differ),
                    "split": f.split,
                }
                for f in self.facts
            },
            "cluster_wide_failures": list(self.cluster_wide),
            "node_failures": {node: list(names) for node, names in self.node_failures.items()},
            "no_result": dict(self.no_result),
            "bandwidth": None
            if self.bandwidth is None
            else {
                "busbw_gbps": dict(self.bandwidth.busbw_gbps),
                "median_gbps": self.bandwidth.median_gbps,
                "fraction": self.bandwidth.fraction,
                "slow": list(self.bandwidth.slow),
            },
            "per_node": {
                node: {
                    "error": r.error,
                    "checks": {
                        name: {
                            "status": status,
                            "detail": r.details.get(name, ""),
                            "fix": r.fixes.get(name, ""),
                        }
                        for name, status in r.statuses.items()
                    },
                    "facts": dict(r.facts),
                }
                for node, r in self.reports.items()
            },
        }


def exclude_option(nodes: Sequence[str]) -> str:
    """Spelled out, not compressed: the reader sees each name, and sbatch/srun take either form."""
    return f"--exclude={','.join(nodes)}" if nodes else ""


def _sorted(nodes: Any) -> tuple[str, ...]:
    return tuple(sorted(nodes, key=natural_key))


def _spread(name: str, values: Mapping[str, Any]) -> FactSpread | None:
    keyed = {node: json.dumps(value, sort_keys=True) for node, value in values.items()}
    counts = Counter(keyed.values())
    if len(counts) < 2:
        return None
    (top, top_count), (_, second_count) = counts.most_common(2)
    majority_nodes = _sorted(n for n, k in keyed.items() if k == top)
    return FactSpread(
        name=name,
        majority=json.loads(top),  # our own json.dumps of the value (keyed above), not a file
        majority_nodes=majority_nodes,
        differ={n: values[n] for n in _sorted(values) if keyed[n] != top},
        split=top_count == second_count,
    )


def bandwidth_outliers(
    busbw: Mapping[str, float | None], fraction: float = DEFAULT_BANDWIDTH_FRACTION
) -> Bandwidth:
    """Nodes below fraction × the median of all nodes' figures, and nodes never measured while others were.

    With no figure at all (the test itself failed) nobody is flagged: that says nothing about any one node.
    """
    known = [v for v in busbw.values() if v is not None]
    if not known:
        return Bandwidth(dict(busbw), None, fraction, ())
    median = statistics.median(known)
    slow = [node for node, value in busbw.items() if value is None or value < fraction * median]
    return Bandwidth(dict(busbw), median, fraction, _sorted(slow))


def analyse(
    reports: Sequence[NodeReport],
    busbw: Mapping[str, float | None] | None = None,
    fraction: float = DEFAULT_BANDWIDTH_FRACTION,
) -> FleetReport:
    by_node = {r.node: r for r in sorted(reports, key=lambda r: natural_key(r.node))}
    answered = [r for r in by_node.values() if r.error is None]
    no_result = {r.node: r.error for r in by_node.values() if r.error is not None}

    names: list[str] = []
    for r in answered:
        names += [n for n in r.statuses if n not in names]
    rows = []
    cluster_wide = []
    node_failures: dict[str, list[str]] = {}
    for name in names:
        groups: dict[str, list[str]] = {}
        for r in answered:
            if name in r.statuses:
                groups.setdefault(r.statuses[name], []).append(r.node)
        rows.append(CheckRow(name, {s: _sorted(groups[s]) for s in STATUSES if s in groups}))
        failed = groups.get("FAIL", [])
        # A check that fails on every node (of several) is the image's or the setup's problem:
        # excluding every node would leave nothing to run on, so it is reported, not excluded.
        if failed and len(failed) == len(answered) and len(answered) > 1:
            cluster_wide.append(name)
            continue
        for node in failed:
            node_failures.setdefault(node, []).append(name)

    fact_names: list[str] = []
    for r in answered:
        fact_names += [n for n in r.facts if n not in fact_names]
    spreads = [
        spread
        for spread in (_spread(n, {r.node: r.facts.get(n) for r in answered}) for n in fact_names)
        if spread is not None
    ]

    bandwidth = bandwidth_outliers(busbw, fraction) if busbw is not None else None
    suspects = set(node_failures) | set(no_result)
    suspects |= {node for s in spreads if not s.split for node in s.differ}
    if bandwidth is not None:
        suspects |= set(bandwidth.slow)
    return FleetReport(
        nodes=tuple(by_node),
        rows=tuple(rows),
        facts=tuple(spreads),
        cluster_wide=tuple(cluster_wide),
        node_failures={n: tuple(node_failures[n]) for n in _sorted(node_failures)},
        no_result={n: no_result[n] for n in _sorted(no_result)},
        bandwidth=bandwidth,
        exclude=_sorted(suspects),
        reports=by_node,
    )
