"""The Python interpreter: SMDDP and hpkit need 3.10 or newer."""

from __future__ import annotations

import sys

from hpkit.checks.context import Context
from hpkit.checks.registry import check
from hpkit.checks.result import Result

MIN_PYTHON = (3, 10)


@check("python", "Python ≥ 3.10", profiles=("login", "compute", "container"))
def python_version(ctx: Context) -> Result:
    found = sys.version_info[:3]
    shown = ".".join(map(str, found))
    if found >= MIN_PYTHON:
        return Result.ok(f"Python {shown} at {sys.executable}")
    return Result.fail(
        f"Python {shown} at {sys.executable}; SageMaker's data-parallel library and hpkit need ≥ 3.10",
        "create the venv from a newer interpreter: `python3.11 -m venv .venv` (conda: `conda create -n train "
        "python=3.11`), or set PYTHON=/path/to/python3.11 for scripts/check-prereqs.sh",
    )
