"""`hpkit data prepare --format chat`: JSONL conversations -> rows of token ids plus their loss-mask flags.

Output (index.json `version` 2, `chat` block): `shard-NNNNN.bin` holds whole rows of seq_len+1 token ids
and `shard-NNNNN.flags.bin` one byte per token (hpkit.data.chat.Packer: COUNT, START) beside them. Every
line is checked as it is read; the directory is built in a hidden sibling and renamed into place only when
complete, so a bad line (reported as file:line) or an interruption leaves nothing half-written: running
the command again starts over. Conversations are few next to pretraining text, so one process renders them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpkit import json_text
from hpkit.data import sources
from hpkit.data.chat import BadExample, ChatEncoder, Packer, PackStats, load_record, messages_of
from hpkit.data.chat_template import load_template
from hpkit.data.index import (
    CHAT_VERSION,
    FORMAT,
    INDEX_NAME,
    flags_name,
    fsync_dir,
    shard_name,
    write_json_atomic,
)
from hpkit.data.prepare import _dtype
from hpkit.data.tokenizer import load as load_tokenizer
from hpkit.errors import HpkitError

ENCODE_BATCH = 256  # conversations rendered, then tokenised together


@dataclass(frozen=True)
class ChatOptions:
    inputs: list[str]
    tokenizer: str
    out: Path
    seq_len: int
    train_on: str = "assistant"
    pack: bool = True
    shard_tokens: int = 100_000_000
    dtype: str = "auto"


@dataclass
class ChatResult:
    out: Path
    shards: int
    stats: PackStats
    already_done: bool = False
    tokens_per_s: float = 0.0


def prepare_chat(opts: ChatOptions) -> ChatResult:
    if opts.seq_len < 1:
        raise HpkitError("--seq-len must be at least 1 (the model's model.seq_len)")
    srcs = sources.resolve(opts.inputs)
    for src in srcs:
        if src.format != "jsonl":
            raise HpkitError(
                f"{src.path}: --format chat reads JSONL conversations (.jsonl), not {src.format}"
            )
    tok_info = load_tokenizer(opts.tokenizer)
    template = load_template(opts.tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_info.json_text)
    special = [
        t["content"] for t in json_text.loads(tok_info.json_text).get("added_tokens", []) if t.get("special")
    ]
    encoder = ChatEncoder(template, tok, opts.train_on, special)
    pad_text = template.special.get("pad_token")
    pad_id = tok.token_to_id(pad_text) if pad_text else None
    pad_id = tok_info.eos_id if pad_id is None else pad_id
    dtype = _dtype(opts.dtype, tok_info.vocab_size)
    manifest = {
        "format": FORMAT,
        "version": CHAT_VERSION,
        "sources": [s.as_json() for s in srcs],
        "tokenizer": {"name": tok_info.name, "sha256": tok_info.sha256},
        "chat_template_sha256": hashlib.sha256(template.source.encode()).hexdigest(),
        "vocab_size": tok_info.vocab_size,
        "eos_id": tok_info.eos_id,
        "dtype": dtype,
        "chat": {"seq_len": opts.seq_len, "train_on": opts.train_on, "packed": opts.pack, "pad_id": pad_id},
    }
    out = opts.out
    done = _already_done(out, manifest)
    if done is not None:
        return done
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HpkitError(
            f"--out {out}: exists and is not an empty directory: remove it or choose another --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        result = _write(
            opts, srcs, encoder, Packer(opts.seq_len, opts.pack, pad_id), dtype, manifest, staging
        )
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.out = out
    return result


def _already_done(out: Path, manifest: dict) -> ChatResult | None:
    index = out / INDEX_NAME
    if not index.is_file():
        return None
    data = json_text.loads(index.read_text(encoding="utf-8"))
    if {k: data.get(k) for k in manifest} != manifest:
        raise HpkitError(
            f"--out {out}: holds a preparation with other inputs or settings: remove it or choose another --out"
        )
    stats = PackStats(**data["chat"]["stats"])
    return ChatResult(out, len(data["shards"]), stats, already_done=True)


def _write(opts, srcs, encoder: ChatEncoder, packer: Packer, dtype: str, manifest: dict, staging: Path):
    rows_per_shard = max(1, opts.shard_tokens // packer.width)
    shards: list[dict] = []
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    start = time.perf_counter()

    def flush() -> None:
        ids = np.stack([r for r, _ in pending]).astype(dtype)
        flags = np.stack([f for _, f in pending])
        number = len(shards)
        shards.append(
            {
                "name": shard_name(number),
                "tokens": int(ids.size),
                "sha256": _write_file(staging / shard_name(number), ids.tobytes()),
                "flags_sha256": _write_file(staging / flags_name(shard_name(number)), flags.tobytes()),
            }
        )
        pending.clear()

    batch: list[tuple[str, int, str, list[tuple[int, int]]]] = []

    def encode_batch() -> None:
        # tokenizers' encode_batch runs in its own threads: tokenising is most of the time here.
        encodings = encoder.tok.encode_batch([text for _, _, text, _ in batch], add_special_tokens=False)
        for (path, lineno, _, spans), enc in zip(batch, encodings, strict=True):
            example = encoder.example(enc, spans)
            if example.ids.max(initial=0) >= np.iinfo(dtype).max + 1:
                raise HpkitError(f"{path}:{lineno}: a token id does not fit {dtype}: use --dtype uint32")
            pending.extend(packer.add(example))
            if len(pending) >= rows_per_shard:
                flush()
        batch.clear()

    for src in srcs:
        with open(src.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text, spans = encoder.render(messages_of(load_record(line)))
                except BadExample as exc:
                    raise HpkitError(f"{src.path}:{lineno}: {exc}; nothing was written") from None
                batch.append((src.path, lineno, text, spans))
                if len(batch) == ENCODE_BATCH:
                    encode_batch()
    if batch:
        encode_batch()
    pending.extend(packer.finish())
    if pending:
        flush()
    if not shards:
        raise HpkitError(f"no conversations in {', '.join(opts.inputs)}: nothing to write")
    stats = packer.stats
    index = {
        **manifest,
        "chat": {**manifest["chat"], "stats": vars(stats)},
        "shards": shards,
        "tokens": sum(s["tokens"] for s in shards),
        "documents": stats.examples,
        "skipped_bad": 0,
    }
    write_json_atomic(staging / INDEX_NAME, index)
    seconds = max(time.perf_counter() - start, 1e-9)
    return ChatResult(staging, len(shards), stats, tokens_per_s=stats.tokens / seconds)


def _write_file(path: Path, blob: bytes) -> str:
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(blob).hexdigest()
