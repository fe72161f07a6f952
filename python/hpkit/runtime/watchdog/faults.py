"""Fault injection for resilience drills: `HPKIT_FAULT` makes a chosen rank misbehave at a chosen step, so that
the hang watchdog, the restarts and `hpkit why` can be exercised on a real cluster (as nvidia-resiliency-ext's
and torchft's injectors do). Off unless the variable is set.

    HPKIT_FAULT="hang:rank=1,step=12"          rank 1 sleeps in Python before step 12 (the others wait in a collective)
    HPKIT_FAULT="slow_save:seconds=20"         every rank's checkpoint saves (the final one too) take 20 s
                                               longer; with step=N only the save of step N
    HPKIT_FAULT="exit:rank=2,step=5,code=3"    rank 2 exits with 3 before step 5
    HPKIT_FAULT="skip:rank=1,step=12"          rank 1 skips the first blocking all-reduce of step 12 (a rank
                                               that leaves out a collective: the others wait in it, it goes on)
    HPKIT_FAULT="stop:rank=1,step=12"          rank 1 sends itself SIGSTOP before step 12: every thread of it
                                               stops, its watchdog's too (a stopped process, or a frozen host)
    HPKIT_FAULT="hang_eval:rank=1,step=4"      rank 1 sleeps in Python as the validation after step 4 begins
                                               (the others wait in its collectives, in phase "eval")

`HPKIT_FAULT_LOG=FILE` appends one JSON line per fault fired (`{"kind", "rank", "step", "at", "pid", "node"}`,
`at` in Unix seconds, taken just before the fault acts; a slow save writes one per rank and save): the drills measure
detection from these raw timestamps.

A fault fires on the first attempt of a job only (HPKIT_STEP_ATTEMPT and SLURM_RESTART_COUNT 0), so that the
restarted step shows the recovery, not the fault again; `attempts=all` makes it fire on every attempt.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from hpkit.job_events import FAULT_ENV, fault_line
from hpkit.runtime.env import node_name

ENV = FAULT_ENV  # the fault line names it
LOG_ENV = "HPKIT_FAULT_LOG"
KINDS = ("hang", "slow_save", "exit", "skip", "stop", "hang_eval")


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
        if kind not in KINDS:
            raise ValueError(f"{ENV}={text!r}: the kind must be one of {', '.join(KINDS)}")
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
        if self.kind not in ("hang", "exit", "skip", "stop") or self.step != step or not self._armed(rank):
            return
        print(fault_line(self.kind, rank, step), file=sys.stderr, flush=True)
        if self.kind == "skip":
            _skip_next_all_reduce(lambda: _log(self.kind, rank, step))
            return
        _log(self.kind, rank, step)
        if self.kind == "exit":
            os._exit(self.code)
        if self.kind == "stop":
            # Whoever continues it (a node leader dumping its stacks, the drill's clean-up) finds it here,
            # and it then hangs like a rank stuck in Python: its step must not go on.
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # a rank stuck in Python: it never reaches the step's collectives
            time.sleep(3600)

    def before_eval(self, rank: int, step: int) -> None:
        """Called as a validation begins, inside its phase: hang_eval is a rank stuck in Python there."""
        if self.kind != "hang_eval" or self.step != step or not self._armed(rank):
            return
        print(fault_line(self.kind, rank, step, in_eval=True), file=sys.stderr, flush=True)
        _log(self.kind, rank, step)
        while True:
            time.sleep(3600)

    def before_save(self, rank: int, step: int) -> None:
        """Called by every save that will write (in-loop, on a signal, final), inside the save phase."""
        if self.kind != "slow_save" or self.step not in (None, step) or not self._armed(rank):
            return
        _log(self.kind, rank, step)
        time.sleep(self.seconds)


def _log(kind: str, rank: int, step: int) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            node = node_name()
            record = {
                "kind": kind,
                "rank": rank,
                "step": step,
                "at": time.time(),
                "pid": os.getpid(),
                "node": node,
            }
            f.write(json.dumps(record) + "\n")


def _skip_next_all_reduce(fired: Any) -> None:
    """Make this rank's next blocking `dist.all_reduce` return at once without communicating (a code path
    that leaves out a collective on one rank), then put the real one back."""
    import torch.distributed as dist

    real = dist.all_reduce

    def skipped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):
            return real(tensor, *args, **kwargs)  # only a blocking call is left out: no Work to fake
        dist.all_reduce = real
        fired()
        return None

    dist.all_reduce = skipped


def from_env() -> Fault | None:
    text = os.environ.get(ENV)
    return Fault.parse(text) if text else None
