"""HPKIT_TEST_CPU_REPORT=FILE: each test file's CPU seconds, its processes and daemons included, appended to FILE
(and each test's to FILE.tests).

A line per file, tab-separated: the file, its CPU seconds, its start and end (Unix time, wall clock) and the xdist
worker that ran it ("main" without xdist). The wall times show the run's timeline: which files ran side by side,
and which one alone at the end kept the run going while a core idled.

The suite is CPU-bound on its 2-core machine, so a file's wall time says more about its neighbours than about
itself. Each pytest process (each xdist worker) moves into a cgroup of its own, which everything it starts stays
in (torchrun's ranks, the clusters' slurmctld and slurmd, their jobs), and charges the group's CPU to the file
running (--dist loadfile runs a file on one worker, start to end). A session fixture's set-up and teardown fall to
the file that ran them. Root only (a new cgroup); off, or where no cgroup can be made, it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

REPORT_ENV = "HPKIT_TEST_CPU_REPORT"


def _hierarchy() -> tuple[Path, str, str] | None:
    """(parent folder, process list file, usage file) of cgroup v1's cpuacct or of cgroup v2."""
    v1 = Path("/sys/fs/cgroup/cpuacct")
    if (v1 / "cpuacct.usage").exists():
        return v1, "cgroup.procs", "cpuacct.usage"
    for v2 in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (v2 / "cgroup.controllers").exists():
            return v2, "cgroup.procs", "cpu.stat"
    return None


class CpuReport:
    def __init__(self, report: Path, group: Path, parent: Path, usage: str):
        self.report, self.group, self.parent, self.usage = report, group, parent, usage
        self.module: str | None = None
        self.mark, self.started = self.used_s(), time.time()
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.tests_report = report.with_name(report.name + ".tests")
        self.test_mark = self.mark

    def used_s(self) -> float:
        text = (self.group / self.usage).read_text()
        if self.usage == "cpu.stat":
            usec = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("usage_usec"))
            return usec / 1e6
        return int(text) / 1e9

    def switch(self, module: str | None) -> None:
        now, wall = self.used_s(), time.time()
        if self.module is not None:
            with self.report.open("a") as out:
                out.write(
                    f"{self.module}\t{now - self.mark:.1f}\t{self.started:.0f}\t{wall:.0f}\t{self.worker}\n"
                )
        self.module, self.mark, self.started = module, now, wall

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: tuple) -> None:
        module = nodeid.split("::", 1)[0]
        if module != self.module:
            self.switch(module)
        self.test_mark = self.used_s()

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple) -> None:
        # A test's own line (set-up, call and teardown, its module fixtures' with the first and last test), in
        # FILE.tests: where a file's seconds go.
        now = self.used_s()
        with self.tests_report.open("a") as out:
            out.write(f"{nodeid}\t{now - self.test_mark:.1f}\t{self.worker}\n")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.switch(None)
        # Back to the parent group with whatever is left running, so the group can go.
        for pid in (self.group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (self.parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.group.rmdir()


def register(config: pytest.Config) -> None:
    report = os.environ.get(REPORT_ENV)
    if not report or os.geteuid() != 0 or (found := _hierarchy()) is None:
        return
    if config.getoption("numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the xdist controller runs no test
    parent, procs, usage = found
    group = parent / f"hpkit-test-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / procs).write_text(str(os.getpid()))
    except OSError:
        return
    config.pluginmanager.register(CpuReport(Path(report), group, parent, usage), "hpkit-cpu-report")
