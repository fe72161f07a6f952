"""Fixed-size shards of token ids, each written as tmp + fsync + rename: a shard file is whole or absent."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from hpkit.data.index import Shard, fsync_dir, shard_name


class ShardWriter:
    """Buffers tokens until a shard is full; `cut()` writes it. Nothing is written for a partial buffer
    unless `cut()` is called at the end of the input, so a run that stops early leaves no partial shard."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int, next_number: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, np.dtype(dtype), shard_tokens
        self.number = next_number
        self._parts: list[np.ndarray] = []
        self.fill = 0

    def room(self) -> int:
        return self.shard_tokens - self.fill

    def append(self, tokens: np.ndarray) -> None:
        self._parts.append(tokens.astype(self.dtype, copy=False))
        self.fill += len(tokens)

    def cut(self) -> Shard:
        data = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=self.dtype)
        blob = data.tobytes()
        name = shard_name(self.number)
        tmp = self.out / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / name)
        fsync_dir(self.out)
        self.number += 1
        self._parts, self.fill = [], 0
        return Shard(name, len(data), hashlib.sha256(blob).hexdigest())
