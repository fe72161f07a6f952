"""The ranks tell the job's supervisor that their signal handlers are in place: one file per rank.

A USR1 passed to a step before its ranks have installed their handlers kills them (the signal's default action),
so the supervisor holds a pending USR1 until every rank of the step has said so (hpkit.supervise.machine).
The step's environment names the folder (READY_ENV, one per step attempt, on the job's shared output folder);
each rank of `hpkit train` writes `rank<R>` there holding the world size, once its handlers are installed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

READY_ENV = "HPKIT_READY_DIR"


def announce(env: Mapping[str, str], rank: int, world: int) -> None:
    """This rank's handlers are in place (nothing to do when no supervisor asked)."""
    folder = env.get(READY_ENV)
    if not folder:
        return
    path = Path(folder)
    with contextlib.suppress(
        OSError
    ):  # the supervisor then passes USR1 when the step ends: never fail a rank
        path.mkdir(parents=True, exist_ok=True)
        part = path / f".rank{rank}.{os.getpid()}"
        part.write_text(str(world), encoding="utf-8")
        part.rename(path / f"rank{rank}")  # whole or absent to the reader


def all_ready(folder: Path) -> bool:
    """Whether every rank of the step has announced (the world size is in each rank's file)."""
    try:
        names = [p for p in folder.iterdir() if p.name.startswith("rank")]
        world = int(names[0].read_text(encoding="utf-8")) if names else 0
    except (OSError, ValueError):
        return False
    return bool(names) and len(names) >= world
