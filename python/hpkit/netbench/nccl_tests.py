"""Read nccl-tests output (all_reduce_perf and friends) into the same rows as `hpkit bench collectives`.

The format is nccl-tests' console output: an optional `# Collective test starting: NAME` line (2.13
and later), `#  Rank  N ...` device lines, a two-line column header (`size count type redop root
time algbw busbw #wrong ...`, once out-of-place then in-place), one line per size, and
`# Avg bus bandwidth : X`. Older versions print `error` instead of `#wrong` and fewer leading
columns, so columns are found by name, not by position. Anything else in the log (NCCL INFO lines,
MPI or Slurm chatter, several tests in one job) is skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hpkit.errors import HpkitError
from hpkit.netbench.results import BenchRow

# nccl-tests binary (minus _perf and a build suffix such as _mpi) -> our collective names.
_BINARY_OPS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all",
    "sendrecv": "sendrecv",
    "gather": "gather",
    "scatter": "scatter",
    "hypercube": "hypercube",
}
_SRUN_LABEL = re.compile(r"^\s*\d+: ")
_START = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_RANK = re.compile(r"^#\s+Rank\s+(\d+)\s")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_HEADER = re.compile(r"^#\s+size\s+count\s+type\b")


class NcclTestsParseError(HpkitError):
    """The text is not nccl-tests output we can read."""


@dataclass
class NcclTestsRun:
    """One nccl-tests binary's run: its collective, rank count, rows and its own average busbw."""

    op: str
    ranks: int
    rows: list[BenchRow] = field(default_factory=list)
    avg_busbw_gbps: float | None = None


def op_from_binary(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    base = re.sub(r"_perf.*$", "", base)
    if base not in _BINARY_OPS:
        raise NcclTestsParseError(f"unknown nccl-tests binary {name!r}: expected e.g. all_reduce_perf")
    return _BINARY_OPS[base]


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def _wrong(token: str) -> int | None:
    # `#wrong` is a count; older versions print the max error as a float (`0e+00`), and `N/A` where
    # a result is not checked (in-place alltoall).
    value = _number(token)
    return None if value is None else int(value)


class _Columns:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.index = {name: names.index(name) for name in ("size", "count", "type") if name in names}
        times = [i for i, n in enumerate(names) if n == "time"]
        if not times:
            raise NcclTestsParseError(f"a column header without a time column: {' '.join(names)}")
        # Each placement is `time algbw busbw wrong`, out-of-place first.
        self.blocks = [(i, i + 1, i + 2, i + 3) for i in times]

    def row(self, tokens: list[str], op: str, ranks: int) -> list[BenchRow]:
        if len(tokens) != len(self.names) or not tokens[0].isdigit():
            return []
        size, count = int(tokens[self.index["size"]]), int(tokens[self.index["count"]])
        dtype = tokens[self.index["type"]]
        rows = []
        for placement, (t, alg, bus, wrong) in enumerate(self.blocks):
            time_us, algbw, busbw = _number(tokens[t]), _number(tokens[alg]), _number(tokens[bus])
            if time_us is None or algbw is None or busbw is None:
                continue
            rows.append(
                BenchRow(
                    source="nccl-tests",
                    op=op,
                    ranks=ranks,
                    size_bytes=size,
                    count=count,
                    dtype=dtype,
                    in_place=placement == 1,
                    time_us=time_us,
                    algbw_gbps=algbw,
                    busbw_gbps=busbw,
                    wrong=_wrong(tokens[wrong]) if wrong < len(tokens) else None,
                    backend="nccl",
                )
            )
        return rows


def parse(text: str, op: str | None = None, source: str = "input") -> list[NcclTestsRun]:
    """Every nccl-tests run in `text`. `op` names the collective where the output does not (before 2.13)."""
    runs: list[NcclTestsRun] = []
    current: NcclTestsRun | None = None
    columns: _Columns | None = None
    max_rank = -1
    for raw in text.splitlines():
        # srun --label (or -l in the user's own srun) puts `RANK: ` before each line.
        line = _SRUN_LABEL.sub("", raw.rstrip(), count=1)
        start = _START.match(line)
        if start:
            current, columns, max_rank = NcclTestsRun(op_from_binary(start.group(1)), 0), None, -1
            runs.append(current)
            continue
        if line.startswith("# nThread") and (current is None or current.rows):
            # A run without a starting line (older nccl-tests): it begins with its parameters.
            if op is None:
                raise NcclTestsParseError(
                    f"{source}: this nccl-tests output does not name its collective (versions before "
                    "2.13): pass --op, e.g. --op all_reduce"
                )
            current, columns, max_rank = NcclTestsRun(op, 0), None, -1
            runs.append(current)
            continue
        if current is None:
            continue
        rank = _RANK.match(line)
        if rank:
            max_rank = max(max_rank, int(rank.group(1)))
            current.ranks = max_rank + 1
            continue
        if _HEADER.match(line):
            columns = _Columns(line.lstrip("#").split())
            continue
        avg = _AVG.match(line)
        if avg:
            current.avg_busbw_gbps = float(avg.group(1))
            continue
        if columns is not None and line[:1] != "#":
            current.rows.extend(columns.row(line.split(), current.op, current.ranks))
    runs = [r for r in runs if r.rows]
    if not runs:
        raise NcclTestsParseError(
            f"{source}: no nccl-tests result lines found: give the output of all_reduce_perf or another "
            "nccl-tests binary (the job's .out file)"
        )
    return runs


def rows_of(runs: list[NcclTestsRun]) -> list[BenchRow]:
    return [row for run in runs for row in run.rows]
