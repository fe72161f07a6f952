"""Side-by-side benchmark plumbing shared by the bench scripts: each run's environment, rounds that rotate which
side goes first (so that a shared machine's load falls on every side alike), and the ratio line they print."""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_env(tmp: Path, **extra: str) -> dict[str, str]:
    """One thread per process, a private TMPDIR, and this checkout's hpkit first on the path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), **extra)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO / "python"), env.get("PYTHONPATH")) if x)
    return env


def alternate(sides: dict[str, Callable[[Path], float]], rounds: int) -> dict[str, list[float]]:
    """Run every side once per round, the first side rotating; each run gets its own empty folder and returns
    tokens/s. Prints each run as it ends."""
    names = list(sides)
    results: dict[str, list[float]] = {name: [] for name in names}
    width = max(len(n) for n in names)
    with tempfile.TemporaryDirectory() as tmp_name:
        for rnd in range(rounds):
            k = rnd % len(names)
            for side in names[k:] + names[:k]:
                out = Path(tmp_name) / f"{side}-{rnd}"
                out.mkdir()
                results[side].append(sides[side](out))
                print(f"round {rnd + 1} {side:{width}s} {results[side][-1]:8,.0f} tokens/s", flush=True)
    return results


def ratio_line(name_a: str, a: list[float], name_b: str, b: list[float]) -> str:
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    return (
        f"{name_a} / {name_b}: ratio of medians {statistics.median(a) / statistics.median(b):.3f}, per round "
        f"{', '.join(f'{r:.3f}' for r in per_round)} (median {statistics.median(per_round):.3f})"
    )
