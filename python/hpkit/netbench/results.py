"""One measured point per row, the same columns whether it came from hpkit or from nccl-tests.

Written as a table for people and as CSV/JSON for spreadsheets and comparisons between clusters.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class BenchRow:
    source: str  # "hpkit" or "nccl-tests"
    op: str
    ranks: int
    size_bytes: int  # nccl-tests' S (see bandwidth.py)
    count: int  # elements, as nccl-tests counts them
    dtype: str
    in_place: bool
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # elements that came out wrong; None where the tool does not check
    backend: str  # gloo, nccl, ...


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(BenchRow))


def to_csv(rows: Iterable[BenchRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        record = asdict(row)
        record["wrong"] = "" if row.wrong is None else row.wrong
        writer.writerow(record)
    return out.getvalue()


def from_csv(text: str) -> list[BenchRow]:
    rows = []
    for record in csv.DictReader(io.StringIO(text)):
        rows.append(
            BenchRow(
                source=record["source"],
                op=record["op"],
                ranks=int(record["ranks"]),
                size_bytes=int(record["size_bytes"]),
                count=int(record["count"]),
                dtype=record["dtype"],
                in_place=record["in_place"] == "True",
                time_us=float(record["time_us"]),
                algbw_gbps=float(record["algbw_gbps"]),
                busbw_gbps=float(record["busbw_gbps"]),
                wrong=int(record["wrong"]) if record["wrong"] else None,
                backend=record["backend"],
            )
        )
    return rows


def to_json(rows: Iterable[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2) + "\n"


def table(rows: Sequence[BenchRow]) -> str:
    """A fixed-width table in nccl-tests' column order, one block per collective."""
    lines = []
    header = (
        f"{'op':<15} {'ranks':>5} {'size(B)':>12} {'count':>11} {'type':>8} {'time(us)':>11} "
        f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"
    )
    last_op = None
    for row in rows:
        if row.op != last_op:
            if last_op is not None:
                lines.append("")
            lines.append(header)
            last_op = row.op
        wrong = "n/a" if row.wrong is None else str(row.wrong)
        op = row.op + (" (in)" if row.in_place else "")
        lines.append(
            f"{op:<15} {row.ranks:>5} {row.size_bytes:>12} {row.count:>11} {row.dtype:>8} "
            f"{row.time_us:>11.2f} {row.algbw_gbps:>12.4f} {row.busbw_gbps:>12.4f} {wrong:>7}"
        )
    return "\n".join(lines) + "\n"


def write_outputs(rows: Sequence[BenchRow], csv_path: str | None, json_path: str | None) -> None:
    for path, text in (
        (csv_path, to_csv(rows) if csv_path else ""),
        (json_path, to_json(rows) if json_path else ""),
    ):
        if path:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
