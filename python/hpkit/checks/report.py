"""Show outcomes as a Rich table (when rich is installed), plain text, or JSON for machines."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hpkit.checks.result import Status
from hpkit.checks.runner import Outcome

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


def exit_code(outcomes: Sequence[Outcome]) -> int:
    return 1 if any(o.result.status is Status.FAIL for o in outcomes) else 0


def summary(outcomes: Sequence[Outcome], profile: str, seconds: float) -> str:
    counts = Counter(o.result.status for o in outcomes)
    parts = [
        f"{counts[s]} {word}"
        for s, word in (
            (Status.PASS, "passed"),
            (Status.WARN, "warned"),
            (Status.FAIL, "failed"),
            (Status.SKIP, "skipped"),
        )
    ]
    return f"profile {profile}: {', '.join(parts)} in {seconds:.2f} s"


def node_name() -> str:
    """The Slurm node this runs on; its hostname outside a job. Emulated nodes share one hostname, and a
    real node's hostname need not be its Slurm name, so the job's own variable comes first."""
    import os
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def to_json(outcomes: Sequence[Outcome], profile: str, seconds: float, sysroot: Path | None = None) -> str:
    import json  # only for --json: every import counts against the login profile's second

    return json.dumps(
        {
            "node": node_name(),
            "sysroot": str(sysroot) if sysroot is not None else None,
            "profile": profile,
            "ok": exit_code(outcomes) == 0,
            "seconds": round(seconds, 3),
            "checks": [
                {
                    "name": o.name,
                    "title": o.title,
                    "status": o.result.status.value,
                    "detail": o.result.detail,
                    "fix": o.result.fix,
                    "seconds": round(o.seconds, 3),
                    "facts": dict(o.result.facts),
                }
                for o in outcomes
            ],
        },
        indent=2,
    )


def plain(outcomes: Sequence[Outcome], profile: str, seconds: float, out: TextIO) -> None:
    width = max((len(o.name) for o in outcomes), default=0)
    for o in outcomes:
        out.write(f"{o.result.status.value:<4}  {o.name:<{width}}  {o.result.detail}\n")
        if o.result.fix and o.result.status is not Status.PASS:
            out.write(f"{'':<4}  {'':<{width}}  fix: {o.result.fix}\n")
    out.write(summary(outcomes, profile, seconds) + "\n")


def rich_table(outcomes: Sequence[Outcome], profile: str, seconds: float) -> bool:
    """Print a Rich table; False when rich is not installed (the login-node script runs without it)."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return False
    table = Table(title="hpkit check", title_justify="left")
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding and fix")
    for o in outcomes:
        status = o.result.status
        # Text, never markup: details quote paths and pip extras such as '.[train]' that Rich would eat.
        cell = Text(o.result.detail)
        if o.result.fix and status is not Status.PASS:
            cell.append("\nfix: " + o.result.fix, style="cyan")
        table.add_row(Text(status.value, style=_STYLE[status]), o.name, cell)
    console = Console()
    console.print(table)
    console.print(Text(summary(outcomes, profile, seconds)))
    return True


def show(
    outcomes: Sequence[Outcome],
    profile: str,
    seconds: float,
    fmt: str,
    out: TextIO | None = None,
    sysroot: Path | None = None,
) -> None:
    out = sys.stdout if out is None else out
    if fmt == "json":
        out.write(to_json(outcomes, profile, seconds, sysroot) + "\n")
    # A table only for a person at a terminal; piped output stays one finding per line, easy to grep.
    elif fmt == "plain" or not (fmt == "table" or out.isatty()) or not rich_table(outcomes, profile, seconds):
        plain(outcomes, profile, seconds, out)
