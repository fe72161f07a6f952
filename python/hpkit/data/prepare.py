"""`hpkit data prepare`: read the inputs in order, tokenise in worker processes, write shards, then the index.

Output is the same for any number of workers: chunks go out to the workers in input order and their
results are taken back in that order. After each shard the state file records the shards so far and
the position of the next token (a document and how many of its tokens are already written), so an
interrupted run continues from its last whole shard and writes exactly what one run would have.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpkit import json_text
from hpkit.data import encode, sources
from hpkit.data.index import (
    FORMAT,
    INDEX_NAME,
    STATE_NAME,
    VERSION,
    Shard,
    shard_name,
    write_json_atomic,
)
from hpkit.data.progress import Progress
from hpkit.data.shards import ShardWriter
from hpkit.data.sources import Position, Source
from hpkit.data.tokenizer import TokenizerInfo
from hpkit.data.tokenizer import load as load_tokenizer
from hpkit.errors import HpkitError

UINT16_VOCAB = 1 << 16
DEFAULT_SHARD_TOKENS = 100_000_000


@dataclass(frozen=True)
class Options:
    inputs: list[str]
    tokenizer: str
    out: Path
    text_field: str = "text"
    workers: int = 1
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    skip_bad: bool = False
    dtype: str = "auto"
    eos_token: str | None = None
    chunk_rows: int = 1000
    chunk_bytes: int = 1 << 20
    progress_every_s: float | None = None


@dataclass
class Result:
    out: Path
    shards: list[Shard]
    documents: int
    skipped_bad: int
    resumed_shards: int = 0  # shards found done by an earlier, interrupted run
    already_done: bool = False
    tokens_per_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


@dataclass
class _State:
    manifest: dict
    shards: list[Shard] = field(default_factory=list)
    cursor: Position = field(default_factory=Position)
    skip: int = 0  # tokens of the cursor's document already in shards
    documents: int = 0
    skipped_bad: int = 0
    rows: int = 0
    input_bytes: float = 0.0

    def as_json(self) -> dict:
        return {
            "manifest": self.manifest,
            "shards": [vars(s) for s in self.shards],
            "cursor": {**vars(self.cursor), "skip": self.skip},
            "documents": self.documents,
            "skipped_bad": self.skipped_bad,
            "rows": self.rows,
            "input_bytes": self.input_bytes,
        }

    @classmethod
    def from_json(cls, data: dict) -> _State:
        cur = data["cursor"]
        return cls(
            manifest=data["manifest"],
            shards=[Shard(s["name"], int(s["tokens"]), s["sha256"]) for s in data["shards"]],
            cursor=Position(int(cur["source"]), int(cur["row"]), int(cur["offset"])),
            skip=int(cur["skip"]),
            documents=int(data["documents"]),
            skipped_bad=int(data["skipped_bad"]),
            rows=int(data.get("rows", 0)),
            input_bytes=float(data.get("input_bytes", 0.0)),
        )


def prepare(opts: Options) -> Result:
    if opts.shard_tokens < 1:
        raise HpkitError("--shard-tokens must be at least 1")
    if opts.workers < 1:
        raise HpkitError("--workers must be at least 1")
    srcs = sources.resolve(opts.inputs)
    sources.check(srcs, opts.text_field)
    tok = load_tokenizer(opts.tokenizer, opts.eos_token)
    dtype = _dtype(opts.dtype, tok.vocab_size)
    manifest = _manifest(srcs, tok, opts, dtype)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    done = _finished(out, manifest)
    if done is not None:
        return done
    state = _resume_state(out, manifest)
    return _run(opts, srcs, tok, dtype, state)


def _dtype(choice: str, vocab: int) -> str:
    if choice == "auto":
        return "uint16" if vocab <= UINT16_VOCAB else "uint32"
    if choice == "uint16" and vocab > UINT16_VOCAB:
        raise HpkitError(
            f"--dtype uint16: the tokenizer has {vocab} tokens, more than uint16 holds ({UINT16_VOCAB}): "
            "use --dtype uint32 (or auto)"
        )
    if choice not in ("uint16", "uint32"):
        raise HpkitError(f"--dtype {choice}: choose auto, uint16 or uint32")
    return choice


def _manifest(srcs: list[Source], tok: TokenizerInfo, opts: Options, dtype: str) -> dict:
    """What decides the output: a resumed run must have all of it the same."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "sources": [s.as_json() for s in srcs],
        "tokenizer": {"name": tok.name, "sha256": tok.sha256},
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "eos_token": tok.eos_token,
        "text_field": opts.text_field,
        "shard_tokens": opts.shard_tokens,
        "dtype": dtype,
    }


def _differences(then: dict, now: dict) -> list[str]:
    found = []
    old_src = {s["path"]: s for s in then.get("sources", [])}
    new_src = {s["path"]: s for s in now["sources"]}
    for path in old_src.keys() - new_src.keys():
        found.append(f"{path} was an input and is not now")
    for path in new_src.keys() - old_src.keys():
        found.append(f"{path} is an input and was not then")
    for path in old_src.keys() & new_src.keys():
        if old_src[path]["bytes"] != new_src[path]["bytes"]:
            found.append(f"{path} had {old_src[path]['bytes']} bytes, now {new_src[path]['bytes']}")
    if not found and [s["path"] for s in then.get("sources", [])] != [s["path"] for s in now["sources"]]:
        found.append("the inputs are in another order")
    for key in now:
        if key != "sources" and then.get(key) != now[key]:
            found.append(f"{key} was {_short(then.get(key))}, now {_short(now[key])}")
    return found


def _short(value: object) -> str:
    if isinstance(value, dict) and "sha256" in value:
        return f"{value.get('name')} (sha256 {str(value['sha256'])[:12]})"
    return repr(value)


def _refuse(out: Path, what: str, diffs: list[str]) -> HpkitError:
    return HpkitError(
        f"{out}: {what} with other settings is there ({'; '.join(diffs)}): "
        "remove it or choose another --out to start over"
    )


def _finished(out: Path, manifest: dict) -> Result | None:
    index_path = out / INDEX_NAME
    if not index_path.exists():
        return None

    try:
        data = json_text.loads(index_path.read_text(encoding="utf-8"))
        diffs = _differences({k: data.get(k) for k in manifest}, manifest)
        shards = [Shard(s["name"], int(s["tokens"]), s["sha256"]) for s in data["shards"]]
        result = Result(out, shards, int(data["documents"]), int(data["skipped_bad"]), already_done=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # An index edited by hand or cut short by a full disk: said in one line, and nothing of it removed.
        raise HpkitError(
            f"{index_path}: unreadable ({type(exc).__name__}: {exc}): remove {out} to start over"
        ) from None
    if diffs:
        raise _refuse(out, "a finished preparation", diffs)
    (out / STATE_NAME).unlink(missing_ok=True)
    return result


def _resume_state(out: Path, manifest: dict) -> _State:

    state_path = out / STATE_NAME
    if not state_path.exists():
        if any(out.glob("shard-*.bin")):
            raise HpkitError(
                f"{out}: holds shard files but no {INDEX_NAME} or {STATE_NAME}: remove them or choose another --out"
            )
        return _State(manifest)
    try:
        state = _State.from_json(json_text.loads(state_path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as exc:
        raise HpkitError(f"{state_path}: unreadable ({exc}): remove {out} to start over") from None
    diffs = _differences(state.manifest, manifest)
    if diffs:
        raise _refuse(out, "an unfinished preparation", diffs)
    item = np.dtype(manifest["dtype"]).itemsize
    for shard in state.shards:
        path = out / shard.name
        if not path.is_file() or path.stat().st_size != shard.tokens * item:
            raise HpkitError(f"{path}: missing or of the wrong size: remove {out} to start over")
    # A shard renamed into place after the last state write, and a tmp file a kill left: written again.
    keep = {s.name for s in state.shards}
    for path in [*out.glob("shard-*.bin"), *out.glob("*.tmp")]:
        if path.name not in keep:
            path.unlink()
    return state


def _encoded(
    chunks: Iterator[sources.Chunk], tok: TokenizerInfo, opts: Options
) -> Iterator[tuple[sources.Chunk, encode.Encoded]]:
    if opts.workers == 1:
        encode.init(tok.json_text, tok.eos_id, opts.text_field, single_thread=False)
        for chunk in chunks:
            yield chunk, encode.encode(chunk.format, chunk.payload)
        return
    # spawn: no copy of this process's threads (pyarrow's, tokenizers') into the workers.
    ctx = multiprocessing.get_context("spawn")
    init = (tok.json_text, tok.eos_id, opts.text_field, True)
    with ctx.Pool(opts.workers, initializer=encode.init, initargs=init) as pool:
        # A bounded window of chunks in flight: ordered results, and the reader stays only a little ahead.
        pending: deque = deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(encode.encode, (chunk.format, chunk.payload))))
            if len(pending) >= 2 * opts.workers:
                first, result = pending.popleft()
                yield first, result.get()
        while pending:
            first, result = pending.popleft()
            yield first, result.get()


def _run(opts: Options, srcs: list[Source], tok: TokenizerInfo, dtype: str, state: _State) -> Result:
    out = opts.out
    writer = ShardWriter(out, dtype, opts.shard_tokens, len(state.shards))
    resumed = len(state.shards)
    progress = Progress(sum(s.size for s in srcs), every_s=opts.progress_every_s)
    progress.resume_at(state.input_bytes, state.rows, sum(s.tokens for s in state.shards))
    skip = state.skip  # only the first document read can have tokens already written
    chunks = sources.chunks(srcs, state.cursor, opts.text_field, opts.chunk_bytes, opts.chunk_rows)
    for chunk, enc in _encoded(chunks, tok, opts):
        problems = {i: (kind, detail) for i, kind, detail in enc.problems}
        ends = np.cumsum(enc.lengths)
        chunk_tokens = 0
        for i in range(len(chunk.payload)):
            state.rows += 1
            if i in problems:
                kind, detail = problems[i]
                if kind == encode.MALFORMED and opts.skip_bad:
                    state.skipped_bad += 1
                    continue
                where = sources.describe(srcs[chunk.source], chunk.starts[i])
                hint = " (or pass --skip-bad to skip such lines)" if kind == encode.MALFORMED else ""
                raise HpkitError(f"{where}: {detail}{hint}; no partial shard was written")
            doc = enc.ids[ends[i] - enc.lengths[i] : ends[i]][skip:]
            written = skip
            skip = 0
            while len(doc) >= writer.room():
                room = writer.room()
                writer.append(doc[:room])
                doc, written = doc[room:], written + room
                finished = len(doc) == 0
                state.shards.append(writer.cut())
                state.input_bytes = progress.bytes + chunk.nbytes * (i + 1) / len(chunk.payload)
                state.cursor = chunk.nexts[i] if finished else chunk.starts[i]
                state.skip = 0 if finished else written
                write_json_atomic(
                    out / STATE_NAME, {**state.as_json(), "documents": state.documents + finished}
                )
                if finished:
                    break
            if len(doc):
                writer.append(doc)
            chunk_tokens += int(enc.lengths[i])
            state.documents += 1
        progress.add(len(chunk.payload), chunk_tokens, chunk.nbytes)
    if writer.fill:
        state.shards.append(writer.cut())
    if not state.shards:
        raise HpkitError(f"no documents in {', '.join(opts.inputs)}: nothing to write")
    _write_index(out, state)
    progress.done()
    return Result(
        out,
        state.shards,
        state.documents,
        state.skipped_bad,
        resumed_shards=resumed,
        tokens_per_s=progress.tokens_per_s(),
    )


def _write_index(out: Path, state: _State) -> None:
    index = {
        **state.manifest,
        "shards": [vars(s) for s in state.shards],
        "tokens": sum(s.tokens for s in state.shards),
        "documents": state.documents,
        "skipped_bad": state.skipped_bad,
    }
    write_json_atomic(out / INDEX_NAME, index)
    (out / STATE_NAME).unlink(missing_ok=True)


__all__ = ["Options", "Result", "prepare", "shard_name"]
