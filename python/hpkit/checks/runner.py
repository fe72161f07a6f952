"""Run checks in parallel, each bounded in time, so one hung probe cannot hold up the report."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hpkit.checks.context import Context
from hpkit.checks.registry import Check
from hpkit.checks.result import Result, Status

# Beyond its own probe timeouts, how long a check may take before the runner gives up on it.
GRACE_S = 1.0


@dataclass(frozen=True)
class Outcome:
    name: str
    title: str
    result: Result
    seconds: float


def _run_one(check: Check, ctx: Context, box: list[Result]) -> None:
    try:
        result = check.fn(ctx)
        if not isinstance(result, Result):
            raise TypeError(f"returned {type(result).__name__}, not Result")
    except Exception as exc:  # a crashing check must still leave a row in the report
        result = Result.fail(
            f"the check itself failed: {type(exc).__name__}: {exc}",
            f"run `hpkit check --only {check.name}` again; if it repeats, report it as an hpkit bug",
        )
    box.append(result)


def run_checks(checks: Sequence[Check], ctx: Context) -> list[Outcome]:
    # A check may wait for the shared metadata probe and then run a command of its own (efa: fi_info).
    budget = ctx.imds_timeout + ctx.probe_timeout + GRACE_S
    started = time.monotonic()
    boxes: list[list[Result]] = [[] for _ in checks]
    done_at: list[float] = [0.0] * len(checks)
    threads = []
    for index, chk in enumerate(checks):

        def target(chk: Check = chk, index: int = index) -> None:
            _run_one(chk, ctx, boxes[index])
            done_at[index] = time.monotonic()

        # Daemon threads: a probe stuck in a system call must not keep the process alive after the report.
        thread = threading.Thread(target=target, name=f"check-{chk.name}", daemon=True)
        thread.start()
        threads.append(thread)
    outcomes = []
    # No zip(strict=): this module must also run on the old Pythons the python check is there to catch.
    for index, chk in enumerate(checks):
        threads[index].join(max(0.0, started + budget - time.monotonic()))
        if boxes[index]:
            outcomes.append(Outcome(chk.name, chk.title, boxes[index][0], done_at[index] - started))
        else:
            result = Result(
                Status.FAIL,
                f"no answer within {budget:g} s",
                "a probe hung: run `hpkit check --only " + chk.name + "` to see which, and fix that service",
            )
            outcomes.append(Outcome(chk.name, chk.title, result, time.monotonic() - started))
    return outcomes
