"""The hang watchdog's verdicts, as the supervisor looks them up (the layout is hpkit.runtime.hang_watchdog's):
`<hangs_dir>/<job>-<restart>-<attempt>-<n>-step<N>/verdict.json`, with `culprit_nodes` beside it (one node a
line, written first)."""

from __future__ import annotations

from pathlib import Path

HANG_EXIT = 75  # what every rank exits with after the watchdog stops a hung step


def verdict_path(hangs_dir: Path, job_id: str, restart: int, attempt: int) -> Path | None:
    found = sorted(hangs_dir.glob(f"{job_id}-{restart}-{attempt}-*-step*/verdict.json"))
    return found[0] if found else None


def culprit_nodes(verdict: Path) -> list[str]:
    try:
        text = (verdict.parent / "culprit_nodes").read_text(encoding="utf-8")
    except OSError:
        return []
    return sorted({line.strip() for line in text.splitlines() if line.strip()})
