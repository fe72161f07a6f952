"""A real slow rank, made by the kernel: a CPU quota on one process's cgroup.

Once training has started, the test calls `limit(name, pid, percent)` with a rank's pid (its hang-watchdog
reports give it), which moves that process (all its threads) into a new cgroup allowed `percent` of one CPU
(cgroup v1 cpu.cfs_quota_us, or v2 cpu.max), and `remove(name)` after the job. Limiting after start-up, not
before, keeps the slow rank's start from taking minutes. Needs root and the cpu controller.
"""

from __future__ import annotations

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


def limit(name: str, pid: int, percent: int) -> Path:
    base = root()
    if base is None:
        raise RuntimeError("no cgroup cpu controller here (v1 /sys/fs/cgroup/cpu or v2 with cpu)")
    group = base / name
    group.mkdir(exist_ok=True)
    quota = PERIOD_US * percent // 100
    if base == V1:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    (group / "cgroup.procs").write_text(str(pid))  # the whole process: every thread moves
    return group


def remove(name: str) -> None:
    base = root()
    if base is not None and (base / name).exists():
        (base / name).rmdir()
