"""What `hpkit plan` prints: the ranked table, the rejections by reason, one layout's verdict, and JSON."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from hpkit.plan.host_memory import HOST_RAM_SHARE
from hpkit.plan.search import GIB, Candidate, SearchResult, why_lost

HEADER = ("#", "layout", "GiB/GPU", "host GiB/rank", "tok/s/GPU", "MFU", "step s", "largest costs")


def _costs(c: Candidate) -> str:
    if c.speed is None:
        return ""
    parts = sorted(c.speed.parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in parts)


def row(i: int | str, c: Candidate) -> tuple[str, ...]:
    speed = c.speed
    return (
        str(i),
        c.layout.describe(),
        f"{c.peak_gib:.1f}" if c.peak_gib is not None else "-",
        f"{c.host.per_rank / GIB:.1f}" if c.host is not None else "-",
        f"{speed.tokens_per_s_per_gpu:,.0f}" if speed else "-",
        f"{speed.mfu * 100:.1f}%" if speed else "-",
        f"{speed.step_s:.3f}" if speed else "-",
        _costs(c),
    )


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [HEADER, *rows]
    ]
    return "\n".join(lines)


def rejections(result: SearchResult, limit: int = 6) -> list[str]:
    """The rejected layouts grouped by the kind of reason, each group with one example."""
    kinds: Counter[str] = Counter()
    example: dict[str, Candidate] = {}
    for c in result.rejected:
        kind = "memory" if c.over_gib is not None else re.split(r"[ =:]", c.problem or "")[0]
        kinds[kind] += 1
        best = example.get(kind)
        if best is None or (c.over_gib is not None and (best.over_gib or 0) > c.over_gib):
            example[kind] = c
    lines = []
    for kind, count in kinds.most_common(limit):
        c = example[kind]
        lines.append(f"  {count} rejected ({kind}), e.g. {c.layout.describe()}: {c.problem}")
    return lines


def host_line(c: Candidate) -> str:
    """What the host column means for this plan: per node, against the node's RAM, configured or not."""
    host = c.host
    node = f"{host.per_node / GIB:,.0f} GiB per node ({host.ranks_per_node} ranks)"
    ram = f" of {host.ram_gib} GiB RAM (copies may take {HOST_RAM_SHARE:.0%})" if host.ram_gib else ""
    if host.configured:
        return f"host GiB/rank: checkpoint.memory's {host.copies} copies of each rank's state: {node}{ram}"
    return (
        f"host GiB/rank: no checkpoint.memory; with one (replicas 1: {host.copies} copies of each rank's state) "
        f"{node}{ram}"
    )


def search_text(title: str, result: SearchResult, top: int) -> str:
    lines = [title, ""]
    shown = result.ranked[:top]
    lines.append(table([row(i + 1, c) for i, c in enumerate(shown)]))
    if shown and shown[0].host is not None:
        lines.append(host_line(shown[0]))
    if len(shown) > 1:
        lines.append("")
        lines.append("why the others rank lower:")
        lines += [f"  #{i + 2}: {why_lost(shown[0], c)}" for i, c in enumerate(shown[1:])]
    lines.append("")
    lines.append(
        f"{len(result.ranked)} layouts fit, {len(result.rejected)} rejected, {result.dominated} not tried (the same "
        "with less activation checkpointing fits, or with full checkpointing does not):"
    )
    lines += rejections(result)
    return "\n".join(lines)


def judge_text(title: str, c: Candidate) -> str:
    lines = [title, "", table([row("-", c)])]
    if c.host is not None:
        lines.append(host_line(c))
    if c.memory is not None:
        worst = c.memory.worst
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in worst.breakdown.as_dict().items() if v)
        lines += ["", f"memory at the peak ({worst.kind}), GiB: {parts}"]
    if c.speed is not None:
        lines += [
            "",
            "step time by part: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in c.speed.parts.items()),
        ]
    lines.append("")
    lines.append(f"verdict: {'fits' if c.fits else 'does not fit'}" + (f": {c.problem}" if c.problem else ""))
    return "\n".join(lines)


def search_json(meta: dict[str, Any], result: SearchResult, top: int) -> dict[str, Any]:
    return {
        **meta,
        "world": result.world,
        "global_batch": result.global_batch,
        "fit": len(result.ranked),
        "ranked": [c.to_json() for c in result.ranked[:top]],
        "rejected": len(result.rejected),
        "not_tried": result.dominated,
        "rejected_examples": [c.to_json() for c in result.rejected[:20]],
    }
