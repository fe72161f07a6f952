"""SMP features with no honest equivalent here: the job stops with one line naming the feature and the
torch-native way to get it. Parameters that change nothing that matters here only warn."""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import NoReturn

from hpkit.smp_params import SMP_PARAMETERS

# The table (hpkit.smp_params) is the one source; these views are what smp.init reads.
# parameter -> the torch-native way to get what it did
UNSUPPORTED_PARAMETERS: dict[str, str] = {
    p.name: p.advice for p in SMP_PARAMETERS.values() if p.status == "refused"
}
# parameter -> why it changes nothing that matters here
IGNORED_PARAMETERS: dict[str, str] = {
    p.name: p.advice for p in SMP_PARAMETERS.values() if p.status == "ignored"
}


# Seconds a rank other than 0 waits before exiting on an SmpExit, so that rank 0's line reaches the log.
QUIET_RANK_EXIT_DELAY_S = 3.0


class SmpExit(SystemExit):
    """Stops the job: rank 0 prints the one line (SystemExit prints its message, no traceback), the other
    ranks exit with status 1 silently, so a job log holds the line once."""

    def __init__(self, line: str) -> None:
        super().__init__(line if _is_rank0() else 1)
        self.line = line
        if not _is_rank0():
            # srun --kill-on-bad-exit ends the step at the first rank that exits non-zero: a silent rank
            # that got here first would kill rank 0 before it printed the line (seen on a loaded machine).
            # Every rank reaches the same check, so rank 0 is at most moments behind.
            atexit.register(time.sleep, QUIET_RANK_EXIT_DELAY_S)


def _is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def stop(feature: str, fix: str) -> NoReturn:
    raise SmpExit(f"smp: {feature} is not supported by hpkit's SMP compatibility layer; {fix}")


def bad_setting(line: str) -> NoReturn:
    """A setting every rank evaluates the same way: every rank stops without a collective."""
    raise SmpExit(f"smp: {line}")


def warn_ignored(name: str, value: object) -> None:
    """One line, from rank 0 only (every rank reads the same parameters)."""
    if _is_rank0():
        print(
            f"smp: warning: {name}={value!r} is ignored: {IGNORED_PARAMETERS[name]}",
            file=sys.stderr,
            flush=True,
        )


def unsupported_call(feature: str, fix: str):
    """A stand-in for an SMP function that stops the job when called."""

    def call(*_args, **_kwargs) -> NoReturn:
        stop(feature, fix)

    call.__name__ = feature.rsplit(".", 1)[-1].rstrip("()")
    return call
