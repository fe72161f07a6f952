"""The nccl-tests parser on nccl-tests output text (fixtures in its documented console format)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.netbench.bandwidth import bus_factor
from hpkit.netbench.nccl_tests import NcclTestsParseError, op_from_binary, parse, rows_of
from hpkit.netbench.results import COLUMNS, from_csv

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl-tests"
REPO = Path(__file__).resolve().parents[2]


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_all_reduce_two_nodes():
    runs = parse(read("all_reduce_perf-2x8-h100.txt"))
    assert len(runs) == 1
    run = runs[0]
    assert (run.op, run.ranks) == ("all_reduce", 16)
    assert run.avg_busbw_gbps == pytest.approx(121.506)
    out = [r for r in run.rows if not r.in_place]
    inp = [r for r in run.rows if r.in_place]
    assert len(out) == len(inp) == 31  # 8 B .. 8 GiB, factor 2
    first, last = out[0], out[-1]
    assert (first.size_bytes, first.count, first.dtype, first.time_us, first.wrong) == (
        8,
        2,
        "float",
        38.37,
        0,
    )
    assert (last.size_bytes, last.time_us, last.algbw_gbps, last.busbw_gbps) == (
        8589934592,
        45770,
        187.68,
        351.89,
    )
    assert inp[-1].busbw_gbps == 350.26
    assert all(r.source == "nccl-tests" and r.backend == "nccl" for r in run.rows)


def test_srun_labelled_output_parses_the_same():
    """A log from srun --label (or the user's own -l): every line starts `RANK: `."""
    text = read("all_reduce_perf-2x8-h100.txt")
    labelled = "\n".join(f"{i % 16:>2}: {line}" for i, line in enumerate(text.splitlines()))
    assert labelled != text and parse(labelled) == parse(text)


def test_printed_bandwidths_follow_the_formulas():
    """Our formulas reproduce nccl-tests' own columns (up to its 2-decimal rounding)."""
    rows = rows_of(parse(read("all_reduce_perf-2x8-h100.txt")) + parse(read("collectives-job-2x8-h100.txt")))
    checked = 0
    for row in rows:
        if row.time_us < 1000:  # short times are printed with too few digits to recompute
            continue
        algbw = row.size_bytes / (row.time_us * 1e-6) / 1e9
        assert algbw == pytest.approx(row.algbw_gbps, rel=2e-3, abs=0.006), row
        busbw = row.algbw_gbps * float(bus_factor(row.op, row.ranks))
        assert busbw == pytest.approx(row.busbw_gbps, rel=2e-3, abs=0.006), row
        checked += 1
    assert checked >= 30


def test_several_tests_in_one_job_log():
    runs = parse(read("collectives-job-2x8-h100.txt"))
    assert [r.op for r in runs] == ["all_gather", "reduce_scatter", "all_to_all", "broadcast"]
    assert all(r.ranks == 16 and len(r.rows) == 22 for r in runs)
    gather = runs[0].rows[0]
    # all_gather: size is the gathered total, count the per-rank elements (1 MiB / 4 B / 16).
    assert (gather.size_bytes, gather.count) == (1048576, 16384)
    alltoall_in_place = [r for r in runs[2].rows if r.in_place]
    assert alltoall_in_place and all(r.wrong is None for r in alltoall_in_place)  # printed N/A


def test_legacy_output_needs_the_op():
    text = read("all_reduce_perf-legacy-1x8-a100.txt")
    with pytest.raises(NcclTestsParseError, match="pass --op"):
        parse(text)
    (run,) = parse(text, op="all_reduce")
    assert run.ranks == 8 and len(run.rows) == 50
    assert run.rows[0].wrong == 0  # `error` column: 0e+00


def test_not_nccl_tests_output():
    with pytest.raises(NcclTestsParseError, match="no nccl-tests result lines"):
        parse("hello\nworld\n", source="x.out")
    with pytest.raises(NcclTestsParseError, match="unknown nccl-tests binary"):
        op_from_binary("frobnicate_perf")
    assert op_from_binary("/opt/nccl-tests/build/alltoall_perf_mpi") == "all_to_all"


def test_cli_parse_writes_the_same_csv_columns(tmp_path):
    csv_path = tmp_path / "out.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "bench", "nccl-tests", "parse", str(FIXTURES / "all_reduce_perf-2x8-h100.txt"),
         "--csv", str(csv_path)],
        capture_output=True, text=True, env={"PYTHONPATH": str(REPO / "python")}, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce: 16 rank(s), 62 row(s)" in proc.stdout
    assert csv_path.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert len(from_csv(csv_path.read_text())) == 62
    bad = subprocess.run(
        [sys.executable, "-m", "hpkit", "bench", "nccl-tests", "parse", str(tmp_path / "missing.out")],
        capture_output=True, text=True, env={"PYTHONPATH": str(REPO / "python")}, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and "missing.out: cannot read" in bad.stderr
