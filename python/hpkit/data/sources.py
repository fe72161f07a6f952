"""Input files and reading them in order, from any position, as chunks of documents for the workers.

Formats, chosen by the file name's ending:
  .jsonl .ndjson .json  one JSON object per line; the document is its `--text-field`; blank lines are ignored
  .parquet              one document per row of the `--text-field` column (string)
  .txt .text .md        one document per file (split a corpus into files, or write JSONL, for more)

A position is (source, row, byte offset of that row): enough to seek straight back to a document on resume.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hpkit.errors import HpkitError

FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}


@dataclass(frozen=True)
class Source:
    path: str
    format: str
    size: int

    def as_json(self) -> dict:
        return {"path": self.path, "format": self.format, "bytes": self.size}


@dataclass(frozen=True)
class Position:
    source: int = 0
    row: int = 0  # 0-based: a JSONL line, a Parquet row, or 0 for a text file
    offset: int = 0  # the row's byte offset (JSONL; else 0)


@dataclass
class Chunk:
    """Consecutive documents of one source. `starts[i]`/`nexts[i]`: where item i and the one after it begin."""

    source: int
    format: str
    payload: list = field(default_factory=list)  # bytes (a JSONL line) or str (Parquet, text); None: a null
    starts: list[Position] = field(default_factory=list)
    nexts: list[Position] = field(default_factory=list)
    nbytes: float = 0.0  # input bytes covered, for the progress line

    def add(self, payload, start: Position, after: Position, nbytes: float) -> None:
        self.payload.append(payload)
        self.starts.append(start)
        self.nexts.append(after)
        self.nbytes += nbytes


def resolve(inputs: list[str]) -> list[Source]:
    """Paths and globs -> files in the order given (each glob's matches sorted), without repeats."""
    seen: set[str] = set()
    found: list[Source] = []
    for item in inputs:
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
        if not matches:
            raise HpkitError(f"{item}: no file matches this pattern")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                raise HpkitError(f"{match}: a directory: name its files, e.g. '{match}/*.jsonl'")
            if not path.is_file():
                raise HpkitError(f"{match}: no such file")
            fmt = FORMATS.get(path.suffix.lower())
            if fmt is None:
                raise HpkitError(
                    f"{match}: unknown format {path.suffix or '(no suffix)'}: name files ending in "
                    f"{', '.join(FORMATS)}"
                )
            resolved = str(path.resolve())
            if resolved not in seen:
                seen.add(resolved)
                found.append(Source(resolved, fmt, path.stat().st_size))
    return found


def check(sources: list[Source], text_field: str) -> None:
    """What can be told before reading: a Parquet file without the text column, or of another type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for src in sources:
        if src.format != "parquet":
            continue
        try:
            schema = pq.ParquetFile(src.path).schema_arrow
        except (OSError, pa.ArrowException) as exc:
            raise HpkitError(f"{src.path}: not a readable Parquet file ({exc})") from None
        if text_field not in schema.names:
            raise HpkitError(
                f"{src.path}: no column {text_field!r} (columns: {', '.join(schema.names)}): "
                "pass --text-field NAME"
            )
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise HpkitError(f"{src.path}: column {text_field!r} is {kind}, not a string column")


def chunks(
    sources: list[Source], start: Position, text_field: str, chunk_bytes: int, chunk_rows: int
) -> Iterator[Chunk]:
    """Every document from `start` on, in order, grouped into chunks of about `chunk_bytes` or `chunk_rows`."""
    for number in range(start.source, len(sources)):
        at = start if number == start.source else Position(number)
        reader = {"jsonl": _jsonl, "parquet": _parquet, "text": _text}[sources[number].format]
        yield from reader(sources[number], at, text_field, chunk_bytes, chunk_rows)


def _jsonl(src: Source, at: Position, _field: str, chunk_bytes: int, chunk_rows: int) -> Iterator[Chunk]:
    row, offset = at.row, at.offset
    chunk = Chunk(at.source, "jsonl")
    with open(src.path, "rb") as f:
        f.seek(offset)
        for line in f:
            here = Position(at.source, row, offset)
            row, offset = row + 1, offset + len(line)
            if not line.strip():
                chunk.nbytes += len(line)
                continue
            chunk.add(line, here, Position(at.source, row, offset), len(line))
            if chunk.nbytes >= chunk_bytes or len(chunk.payload) >= chunk_rows:
                yield chunk
                chunk = Chunk(at.source, "jsonl")
    if chunk.payload or chunk.nbytes:
        yield chunk


def _parquet(src: Source, at: Position, text_field: str, _bytes: int, chunk_rows: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src.path)
    total = max(1, pf.metadata.num_rows)
    first_group, group_start = 0, 0
    while first_group < pf.num_row_groups:
        rows = pf.metadata.row_group(first_group).num_rows
        if group_start + rows > at.row:
            break
        group_start += rows
        first_group += 1
    if first_group >= pf.num_row_groups:
        return
    row = group_start
    batches = pf.iter_batches(
        batch_size=chunk_rows, row_groups=list(range(first_group, pf.num_row_groups)), columns=[text_field]
    )
    for batch in batches:
        values = batch.column(0).to_pylist()
        chunk = Chunk(at.source, "parquet")
        for value in values:
            if row >= at.row:
                chunk.add(value, Position(at.source, row), Position(at.source, row + 1), src.size / total)
            row += 1
        if chunk.payload:
            yield chunk


def _text(src: Source, at: Position, _field: str, _bytes: int, _rows: int) -> Iterator[Chunk]:
    if at.row > 0:
        return
    data = Path(src.path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HpkitError(f"{src.path}: not UTF-8 text (byte {exc.start}): convert it to UTF-8") from None
    chunk = Chunk(at.source, "text")
    chunk.add(text, Position(at.source, 0), Position(at.source, 1), len(data))
    yield chunk


def describe(src: Source, pos: Position) -> str:
    """Where a document is, for messages: file:line for JSONL, file: row N for Parquet (both 1-based)."""
    if src.format == "jsonl":
        return f"{src.path}:{pos.row + 1}"
    if src.format == "parquet":
        return f"{src.path}: row {pos.row + 1}"
    return src.path


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
