"""Run a command under a CPU quota when it is one chosen Slurm task: a real slow rank, made by the kernel.

    python _cpu_quota.py CGROUP_NAME TASK PERCENT -- COMMAND...

Task TASK (SLURM_PROCID) moves itself into a new cgroup allowed PERCENT of one CPU (cgroup v1
cpu.cfs_quota_us, or v2 cpu.max), then execs COMMAND; the other tasks exec it as they are. The test
removes the cgroup afterwards (`remove`). Needs root and the cpu controller.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def root() -> Path | None:
    """Where a cpu-controlled cgroup can be made here, or None."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2
    return None


def limit(name: str, percent: int) -> Path:
    base = root()
    if base is None:
        raise SystemExit("no cgroup cpu controller here (v1 /sys/fs/cgroup/cpu or v2 with cpu)")
    group = base / name
    group.mkdir(exist_ok=True)
    quota = PERIOD_US * percent // 100
    if base == V1:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def remove(name: str) -> None:
    base = root()
    if base is not None and (base / name).exists():
        (base / name).rmdir()


def main(argv: list[str]) -> None:
    name, task, percent, sep, *command = argv
    assert sep == "--" and command, __doc__
    if os.environ.get("SLURM_PROCID") == task:
        group = limit(name, int(percent))
        print(
            f"cpu-quota: task {task} on {os.environ.get('SLURMD_NODENAME')} limited to {percent}% in {group}"
        )
        sys.stdout.flush()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
