"""`hpkit bench` options: mistakes are one line naming the option, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkit", "bench", *args],
        capture_output=True, text=True, env={"PYTHONPATH": str(REPO / "python")}, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["collectives", "--ops", "allreduce"], "unknown collective(s) allreduce: choose from all_reduce"),
        (["collectives", "-b", "eight"], "argument -b/--min-bytes: 'eight' is not a size"),
        (["collectives", "-b", "1M", "-e", "1K"], "argument -b/-e/-f: the smallest size"),
        (["nccl-tests", "render", "--tests", "all_reduce"], "--tests: unknown nccl-tests binary all_reduce"),
        (["nccl-tests", "render", "--time", "soon"], "time_limit: 'soon' is not a Slurm time"),
        (["frobnicate"], "unknown subcommand 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line(args, message):
    proc = bench(*args)
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr
    assert any(message in line for line in proc.stderr.splitlines()), proc.stderr


def test_single_process_run_prints_the_table(tmp_path):
    proc = bench("collectives", "--ops", "all_reduce,all_to_all", "-b", "64", "-e", "256", "-n", "2", "-w", "0",
                 "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 rank(s), backend gloo" in proc.stdout
    assert "# Avg bus bandwidth all_to_all" in proc.stdout
    assert (tmp_path / "r.json").read_text().count('"op"') == 6
