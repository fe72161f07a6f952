"""The one restart budget of a job, kept in a file beside its log (hpkit.job_events.budget_path).

Every restart counts once, whoever made it: a step restarted in the allocation (a hang, a lost node swapped
for a spare), hpkit's own requeue after USR1, and a requeue Slurm made by itself after a node failure (counted
by the run it starts, since the run that was requeued could not). `max_restarts: 2` is two restarts in all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpkit import json_text
from hpkit.job_events import write_atomically


@dataclass
class Budget:
    max_restarts: int
    used: int = 0
    # The runs (Slurm restart counts) whose start is already counted: hpkit counts its own requeue before
    # asking for it, and a run Slurm requeued counts itself when it starts.
    counted_runs: list[int] = field(default_factory=list)

    @property
    def left(self) -> int:
        return max(self.max_restarts - self.used, 0)

    def can_restart(self) -> bool:
        return self.used < self.max_restarts

    def spend(self) -> None:
        self.used += 1

    def count_run(self, restart: int) -> bool:
        """Count run `restart` (a requeue) unless it is counted already; True when this call counted it."""
        if restart <= 0 or restart in self.counted_runs:
            return False
        self.counted_runs.append(restart)
        self.used += 1
        return True

    @classmethod
    def load(cls, path: Path, max_restarts: int) -> Budget:
        try:
            data = json_text.loads(path.read_text(encoding="utf-8"))
            return cls(max_restarts, int(data["used"]), [int(r) for r in data["counted_runs"]])
        except (OSError, ValueError, KeyError, TypeError):
            return cls(max_restarts)

    def save(self, path: Path) -> None:
        write_atomically(
            path, {"max_restarts": self.max_restarts, "used": self.used, "counted_runs": self.counted_runs}
        )
