"""argparse value types shared by the commands and by the library's own `python -m` entry points.

Torch-free and at the bottom of the import graph, so that a library module with a command line of its
own (hpkit.netbench.pairs) need not import a command module to parse its flags.
"""

from __future__ import annotations

import argparse
import math
import re

from hpkit.sizes import parse_size

# A job (1234) or a task of a job array (1234_5): what Slurm's commands accept and hpkit's job commands read.
_JOB_ID = re.compile(r"\d+(_\d+)?", re.ASCII)  # ASCII: "٣٠" is no Slurm job id


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError("must be a finite number")
    if value <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def byte_size(text: str) -> int:
    """A size such as 16M or 8G, in bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def job_id_problem(text: str) -> str | None:
    """Why `text` is not a Slurm job id (the message a user sees); None when it is one."""
    if _JOB_ID.fullmatch(text.strip()):
        return None
    return f"{text!r} is not a Slurm job id (a number such as 1234), or JOB_TASK for a task of a job array (1234_5)"


def job_id(text: str) -> str:
    problem = job_id_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text.strip()
