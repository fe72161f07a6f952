"""Token data: synthetic, a memory-mapped file of token ids, or a prepared directory (`hpkit data prepare`),
as one global stream of samples.

Step s uses the global samples [s*G, (s+1)*G) for a global batch G; data-parallel rank r takes its
contiguous slice of them. The stream therefore does not depend on the layout: a run resumed with a
different data-parallel degree continues with exactly the samples the old run would have seen.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from hpkit.errors import SpecError


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a counter-based hash, so any sample's randomness comes from its index alone."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class SyntheticTokens:
    """Learnable sequences (a random start and stride per sample, modulo the vocabulary): the loss
    falls, so a demo shows training working. A batch is a few vectorised integer operations, so data
    costs nothing next to a step even on a GPU."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __len__(self) -> int:
        return 2**62

    def batch(self, first: int, count: int) -> torch.Tensor:
        golden = np.uint64(0x9E3779B97F4A7C15)
        index = np.arange(first, first + count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            seed_key = _mix64(np.array([self.seed % 2**64], dtype=np.uint64) + golden)
            key = _mix64((index + np.uint64(1)) * golden + seed_key)
        start = (key % np.uint64(self.vocab_size)).astype(np.int64)
        stride = 1 + ((key >> np.uint64(32)) % np.uint64(min(15, self.vocab_size - 1))).astype(np.int64)
        rows = (start[:, None] + stride[:, None] * np.arange(self.seq_len + 1)) % self.vocab_size
        return torch.from_numpy(rows)

    def sample(self, index: int) -> torch.Tensor:
        return self.batch(index, 1)[0]


class _Windows:
    """Sample i is a window of seq_len+1 tokens of one token stream; windows are visited in a seeded
    permutation per epoch, so the order is shuffled yet reproducible from (seed, position) alone."""

    field = "train.data.path"

    def __init__(self, length: int, seq_len: int, seed: int, vocab_size: int, name: str) -> None:
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size
        self.windows = (length - 1) // seq_len
        if self.windows < 1:
            raise SpecError(f"{self.field}: {name} holds {length} tokens, fewer than seq_len+1")
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        return self.windows

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return self._perm

    def _read(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    def sample(self, index: int) -> torch.Tensor:
        epoch, i = divmod(index, self.windows)
        w = int(self._order(epoch)[i])
        chunk = self._read(w * self.seq_len, w * self.seq_len + self.seq_len + 1)
        if chunk.max(initial=0) >= self.vocab_size:
            raise SpecError(
                f"{self.field} holds token id {int(chunk.max())} but the model's vocabulary is {self.vocab_size}"
            )
        return torch.from_numpy(chunk)


class TokenFile(_Windows):
    """A flat binary file of uint16/uint32 token ids, read through a memory map."""

    def __init__(self, path: str | Path, dtype: str, seq_len: int, seed: int, vocab_size: int) -> None:
        path = Path(path)
        if not path.is_file():
            raise SpecError(f"train.data.path: {path} is not a file")
        item = np.dtype(dtype).itemsize
        size = path.stat().st_size
        if size % item:
            raise SpecError(f"train.data.path: {path} has {size} bytes, not a whole number of {dtype} tokens")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        super().__init__(len(self.tokens), seq_len, seed, vocab_size, str(path))

    def _read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.tokens[start:stop], dtype=np.int64)


class ChatRows:
    """A chat directory from `hpkit data prepare --format chat`: whole rows of seq_len+1 tokens with their
    loss-mask flags, visited in a seeded permutation per epoch (like _Windows), so that a resumed run
    continues mid-epoch from (seed, position) alone. Packed rows carry several conversations: the loader
    then hands the model positions that restart at each, and the model keeps attention inside each."""

    field = "train.data.path"
    masked = True

    def __init__(self, index, seq_len: int, seed: int, vocab_size: int) -> None:
        from hpkit.data.index import flags_name

        chat = index.chat
        if chat["seq_len"] != seq_len:
            raise SpecError(
                f"{self.field}: {index.path} was prepared for seq_len {chat['seq_len']}, the model has "
                f"{seq_len}: set model.seq_len: {chat['seq_len']} or prepare again with --seq-len {seq_len}"
            )
        self.width, self.seed, self.packed = seq_len + 1, seed, bool(chat["packed"])
        shards = [s for s in index.shards if s.tokens]
        self.ids = [np.memmap(index.path / s.name, dtype=index.dtype, mode="r") for s in shards]
        self.flags = [np.memmap(index.path / flags_name(s.name), dtype=np.uint8, mode="r") for s in shards]
        self.starts = np.cumsum([0] + [len(a) // self.width for a in self.ids])
        self.rows = int(self.starts[-1])
        if self.rows < 1:
            raise SpecError(f"{self.field}: {index.path} holds no rows")
        self._perm_epoch, self._perm = -1, np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.rows

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, i = divmod(index, self.rows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
            self._perm_epoch = epoch
        r = int(self._perm[i])
        shard = int(np.searchsorted(self.starts, r, side="right")) - 1
        at = (r - int(self.starts[shard])) * self.width
        return (
            np.asarray(self.ids[shard][at : at + self.width], dtype=np.int64),
            np.asarray(self.flags[shard][at : at + self.width]),
        )

    def sample(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.row(index)[0])


class PreparedTokens(_Windows):
    """A directory from `hpkit data prepare`: its shards, memory-mapped, read as one stream in shard order
    (a window may span two shards)."""

    def __init__(self, path: str | Path, seq_len: int, seed: int, vocab_size: int) -> None:
        from hpkit.data.index import read_index
        from hpkit.errors import HpkitError

        try:
            index = read_index(path)
        except HpkitError as exc:
            raise SpecError(str(exc)) from None
        if index.vocab_size > vocab_size:
            raise SpecError(
                f"train.data.path: {path} was tokenised with a vocabulary of {index.vocab_size}, more than "
                f"the model's {vocab_size}: set model.vocab_size to at least {index.vocab_size}"
            )
        self.shards = [
            np.memmap(index.path / s.name, dtype=index.dtype, mode="r") for s in index.shards if s.tokens
        ]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        super().__init__(int(self.starts[-1]), seq_len, seed, vocab_size, str(path))

    def _read(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, at = [], start
        while at < stop:
            shard = self.shards[first]
            end = min(stop, int(self.starts[first + 1]))
            parts.append(shard[at - self.starts[first] : end - self.starts[first]])
            at, first = end, first + 1
        return np.concatenate(parts).astype(np.int64)


@dataclass
class DataLoader:
    """This rank's batches. `position` counts global samples consumed; it is all a resume needs."""

    source: SyntheticTokens | TokenFile | PreparedTokens | ChatRows
    local_batch: int
    dp_rank: int
    dp_degree: int
    position: int = 0
    # A debug record (HPKIT_DATA_DIGESTS): one line per sample read, "global-index sha1", so that tests can
    # compare what runs saw.
    digests: TextIO | None = None

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.dp_degree

    @property
    def masked(self) -> bool:
        """Whether some labels may be IGNORE_INDEX (chat data): the loss then counts them per step."""
        return bool(getattr(self.source, "masked", False))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels); chat data's labels are IGNORE_INDEX where a token does not count. Packed chat
        data also needs its positions: next_batch_with_positions."""
        inputs, labels, _ = self.next_batch_with_positions()
        return inputs, labels

    def next_batch_with_positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, labels, positions): positions (restarting at 0 at each packed conversation) for packed
        chat data, else None (one causal sequence per row)."""
        first = self.position + self.dp_rank * self.local_batch
        if isinstance(self.source, ChatRows):
            return self._chat_batch(first)
        if isinstance(self.source, SyntheticTokens):
            rows = self.source.batch(first, self.local_batch)
        else:
            rows = torch.stack([self.source.sample(first + j) for j in range(self.local_batch)])
        if self.digests is not None:
            for j, row in enumerate(rows):
                self.digests.write(f"{first + j} {hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16]}\n")
        self.position += self.global_batch
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), None

    def _chat_batch(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        from hpkit.data.chat import row_labels_positions
        from hpkit.runtime.loop.loss import IGNORE_INDEX

        source = self.source
        assert isinstance(source, ChatRows)
        pairs = [source.row(first + j) for j in range(self.local_batch)]
        rows, flags = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
        if self.digests is not None:
            for j in range(self.local_batch):
                self.digests.write(f"{first + j} {hashlib.sha1(rows[j].tobytes()).hexdigest()[:16]}\n")
        self.position += self.global_batch
        inputs, labels, positions = row_labels_positions(rows, flags, IGNORE_INDEX)
        return (
            torch.from_numpy(np.ascontiguousarray(inputs)),
            torch.from_numpy(np.ascontiguousarray(labels)),
            torch.from_numpy(np.ascontiguousarray(positions)) if source.packed else None,
        )

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def build_source(kind: str, path: str | None, dtype: str, seq_len: int, seed: int, vocab_size: int):
    if kind == "synthetic":
        return SyntheticTokens(vocab_size, seq_len, seed)
    if kind == "prepared":
        from hpkit.data.index import read_index
        from hpkit.errors import HpkitError

        try:
            index = read_index(path)
        except HpkitError as exc:
            raise SpecError(str(exc)) from None
        if index.chat is not None:
            if index.vocab_size > vocab_size:
                raise SpecError(
                    f"train.data.path: {path} was tokenised with a vocabulary of {index.vocab_size}, more than "
                    f"the model's {vocab_size}: set model.vocab_size to at least {index.vocab_size}"
                )
            return ChatRows(index, seq_len, seed, vocab_size)
        return PreparedTokens(path, seq_len, seed, vocab_size)
    return TokenFile(path, dtype, seq_len, seed, vocab_size)
