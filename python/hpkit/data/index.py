"""The prepared directory's format: `shard-00000.bin`... (token ids, one dtype) and `index.json`, written last.

Version 1 is a token stream. Version 2 (`hpkit data prepare --format chat`) holds rows of seq_len+1 tokens
and, beside each shard, `shard-00000.flags.bin`: a byte per token saying whether it counts in the loss and
whether a document starts there (hpkit.data.chat.Packer); its index has a `chat` block.

While a preparation runs, `.prepare-state.json` records the shards written so far and where in the input the
next shard starts; it is what a resumed run continues from, and it is removed once `index.json` is written.
Standard library only: the training runtime reads this without the `data` extra.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpkit import json_text
from hpkit.errors import HpkitError

INDEX_NAME = "index.json"
STATE_NAME = ".prepare-state.json"
FORMAT = "hpkit-prepared"
VERSION = 1
CHAT_VERSION = 2


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.bin"


def flags_name(shard: str) -> str:
    """The loss-mask flags beside a chat shard."""
    return shard.removesuffix(".bin") + ".flags.bin"


@dataclass(frozen=True)
class Shard:
    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class Index:
    """What training needs from `index.json` (the file holds more: sources, tokenizer, options)."""

    path: Path
    dtype: str
    shards: list[Shard]
    documents: int
    vocab_size: int
    eos_id: int
    chat: dict[str, Any] | None = None  # version 2: seq_len, train_on, packed, pad_id, stats

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """tmp + fsync + rename (+ fsync of the folder): a reader sees the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(directory: str | Path, field: str = "train.data.path") -> Index:
    """The index of a finished preparation; HpkitError (one line naming `field`) for anything else."""
    directory = Path(directory)
    path = directory / INDEX_NAME
    if not path.is_file():
        hint = (
            "the preparation did not finish: run `hpkit data prepare` again with the same arguments to resume it"
            if (directory / STATE_NAME).exists()
            else "make one with `hpkit data prepare INPUT... --tokenizer DIR --out DIR`"
        )
        raise HpkitError(f"{field}: {directory} has no {INDEX_NAME}: {hint}")
    try:
        data = json_text.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT or data.get("version") not in (VERSION, CHAT_VERSION):
            raise ValueError(f"not an {FORMAT} version {VERSION} or {CHAT_VERSION} index")
        chat = data["chat"] if data["version"] == CHAT_VERSION else None
        if chat is not None and not isinstance(chat.get("seq_len"), int):
            raise ValueError("its chat block has no seq_len")
        shards = [Shard(s["name"], int(s["tokens"]), s["sha256"]) for s in data["shards"]]
        index = Index(
            directory,
            data["dtype"],
            shards,
            int(data["documents"]),
            int(data["vocab_size"]),
            int(data["eos_id"]),
            chat,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise HpkitError(f"{field}: {path} is not a valid index ({exc})") from None
    if index.dtype not in ("uint16", "uint32"):
        raise HpkitError(f"{field}: {path}: dtype {index.dtype!r} is neither uint16 nor uint32")
    item = 2 if index.dtype == "uint16" else 4
    files = [(directory / s.name, s.tokens * item) for s in shards]
    if chat is not None:
        files += [(directory / flags_name(s.name), s.tokens) for s in shards]
    for file, expected in files:
        size = file.stat().st_size if file.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size} bytes"
            raise HpkitError(f"{field}: {file} is {found}, the index says {expected}: prepare the data again")
    return index
