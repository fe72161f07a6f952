"""Fault injection for resilience drills: `HPKIT_FAULT` makes a chosen rank misbehave at a chosen step, so that
the hang watchdog, the restarts and `hpkit why` can be exercised on a real cluster (as nvidia-resiliency-ext's
and torchft's injectors do). Off unless the variable is set.

    HPKIT_FAULT="hang:rank=1,step=12"          rank 1 sleeps in Python before step 12 (the others wait in a collective)
    HPKIT_FAULT="slow_save:seconds=20"         every rank's checkpoint save takes 20 s longer
    HPKIT_FAULT="exit:rank=2,step=5,code=3"    rank 2 exits with 3 before step 5

A fault fires on the first attempt of a job only (HPKIT_STEP_ATTEMPT and SLURM_RESTART_COUNT 0), so that the
restarted step shows the recovery, not the fault again; `attempts=all` makes it fire on every attempt.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

ENV = "HPKIT_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    seconds: float = 0.0
    code: int = 1
    every_attempt: bool = False

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, rest = text.partition(":")
        fields: dict[str, str] = dict(item.split("=", 1) for item in rest.split(",") if "=" in item)
        if kind not in ("hang", "slow_save", "exit"):
            raise ValueError(f"{ENV}={text!r}: the kind must be hang, slow_save or exit")
        return cls(
            kind=kind,
            rank=int(fields["rank"]) if "rank" in fields else None,
            step=int(fields["step"]) if "step" in fields else None,
            seconds=float(fields.get("seconds", "0")),
            code=int(fields.get("code", "1")),
            every_attempt=fields.get("attempts") == "all",
        )

    def _armed(self, rank: int) -> bool:
        if self.rank is not None and rank != self.rank:
            return False
        first = (
            os.environ.get("HPKIT_STEP_ATTEMPT", "0") == "0"
            and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        )
        return self.every_attempt or first

    def before_step(self, rank: int, step: int) -> None:
        if self.kind not in ("hang", "exit") or self.step != step or not self._armed(rank):
            return
        print(
            f"hpkit: fault injected ({ENV}): {self.kind} on rank {rank} before step {step}",
            file=sys.stderr,
            flush=True,
        )
        if self.kind == "exit":
            os._exit(self.code)
        while True:  # a rank stuck in Python: it never reaches the step's collectives
            time.sleep(3600)

    def before_save(self, rank: int) -> None:
        if self.kind == "slow_save" and self._armed(rank):
            time.sleep(self.seconds)


def from_env() -> Fault | None:
    text = os.environ.get(ENV)
    return Fault.parse(text) if text else None
