"""The hang watchdog's verdicts, as the supervisor looks them up (the layout is hpkit.job_events'):
`<hangs_dir>/<job>-<restart>-<attempt>-<n>-step<N>/verdict.json`, with `culprit_nodes` beside it (one node a
line, written first)."""

from __future__ import annotations

from pathlib import Path

from hpkit import json_text
from hpkit.job_events import CULPRIT_NODES, VERDICT_JUDGE, verdict_paths


def verdict_path(hangs_dir: Path, job_id: str, restart: int, attempt: int) -> Path | None:
    found = verdict_paths(hangs_dir, job_id, restart, attempt)
    return found[0] if found else None


def culprit_nodes(verdict: Path) -> list[str]:
    try:
        text = (verdict.parent / CULPRIT_NODES).read_text(encoding="utf-8")
    except OSError:
        return []
    return sorted({line.strip() for line in text.splitlines() if line.strip()})


def verdict_judge(verdict: Path) -> str | None:
    """The node whose watchdog wrote the verdict (its "judge"), or None where the verdict does not say."""
    try:
        judge = json_text.loads(verdict.read_text(encoding="utf-8")).get(VERDICT_JUDGE)
    except (OSError, ValueError, AttributeError):
        return None
    return judge if isinstance(judge, str) and judge else None
