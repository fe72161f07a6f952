"""The PATH a job's tasks get, and the programs they must find on it.

sbatch hands the job the submitting shell's environment (--export=ALL). A user who runs
`/path/to/venv/bin/hpkit submit job.yaml` without activating the venv submits a PATH without that venv,
and every node then fails with `execve(): torchrun: No such file or directory`. So `hpkit submit` puts
the scripts folder of the environment it runs from first on the job's PATH, and refuses before sbatch
when the launcher or the program still cannot be found there. A container's programs are the image's:
nothing is added or checked for them.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from hpkit.errors import HpkitError


def environment_scripts() -> str:
    """The folder where this Python environment's console scripts (hpkit, hpkit-torchrun, torchrun) live."""
    return sysconfig.get_path("scripts")


def job_path(environ: Mapping[str, str], scripts: str | None = None) -> str:
    """`environ`'s PATH with this environment's scripts folder first (once)."""
    scripts = scripts or environment_scripts()
    entries = [e for e in environ.get("PATH", "").split(os.pathsep) if e]
    if scripts in entries:
        return os.pathsep.join(entries)
    return os.pathsep.join([scripts, *entries])


def required_programs(launcher: str, command: list[str]) -> list[str]:
    """What each node execs first outside a container: the launcher's program, then the command's."""
    programs = ["hpkit-torchrun"] if launcher == "torchrun" else []
    return [*programs, command[0]]


def check_programs(programs: list[str], path: str, workdir: Path) -> None:
    """HpkitError naming the first program the job's PATH lacks, and the fix."""
    for program in programs:
        if "/" in program:
            found = (workdir / program).is_file() and os.access(workdir / program, os.X_OK)
        else:
            found = shutil.which(program, path=path) is not None
        if not found:
            raise HpkitError(
                f"{program} is not on the job's PATH ({path}): the job would fail on every node with "
                f"'execve(): {program}: No such file or directory'; activate the environment that has it "
                f"(source /path/to/venv/bin/activate), install it there, or set the program's full path in "
                "the spec's command"
            )
