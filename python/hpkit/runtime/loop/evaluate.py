"""Validation: the masked loss and perplexity of the model on a held-out set (`eval:` in the run config).

The number is the mean over every counted token of the set (a label other than IGNORE_INDEX): each rank
sums its tokens' losses and counts them, and the two sums are all-reduced. A mean of per-batch (or per-rank)
means would weigh a token of a short batch more than one of a long batch, and would change with the layout.

The set is read in batches of train.local_batch_size samples; batch b goes to data-parallel rank b % dp, in
rounds of dp batches. When the batches do not divide evenly, a rank without a batch in the last round runs an
empty one: a batch whose labels are all IGNORE_INDEX. Its forward still runs, because FSDP's all-gathers,
tensor parallel's all-reduces, expert parallel's all-to-alls and the pipeline's sends are collectives its
peers are waiting in; skipping it would hang them (a known failure of validation loops). A partial last batch
is filled up the same way, so that every batch has the shape the pipeline's stages were built for.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpkit.errors import SpecError
from hpkit.runtime.config import EvalSpec
from hpkit.runtime.loop import data as data_mod
from hpkit.runtime.loop.loss import IGNORE_INDEX, masked_loss_sum

if TYPE_CHECKING:
    from hpkit.runtime.loop.trainer import Trainer


@dataclass(frozen=True)
class EvalResult:
    """One validation: the token-weighted mean loss over the set, and what it was taken over."""

    step: int
    loss: float
    perplexity: float
    tokens: int  # counted tokens of the whole set (every data-parallel rank)
    batches: int  # batches of the set that held samples
    seconds: float

    def line(self) -> str:
        return (
            f"eval loss {self.loss:.4f} | ppl {self.perplexity:.2f} | {self.tokens:,} tokens in "
            f"{self.batches} batches | {self.seconds * 1000:.0f} ms"
        )


def token_weighted_mean(loss_sum: float, count: float) -> tuple[float, float]:
    """(mean loss, perplexity) from the summed loss and count of the counted tokens."""
    if count <= 0:
        raise ValueError("no counted token: the mean is undefined")
    loss = loss_sum / count
    return loss, math.exp(loss) if loss < 700 else math.inf


def rank_rounds(n_batches: int, dp_rank: int, dp: int) -> list[int | None]:
    """The batch this data-parallel rank runs in each round (batch b on rank b % dp); None: an empty batch.

    Every rank gets the same number of rounds, ceil(n_batches / dp): that is what keeps them in step."""
    rounds = -(-n_batches // dp)
    return [b if (b := r * dp + dp_rank) < n_batches else None for r in range(rounds)]


class EvalSet:
    """The held-out set as batches of `local_batch` samples.

    It reads through the training data's own loader (so masks, packing and token checks are the same),
    positioned at the batch; samples past the end of the set (the loader wraps into the next epoch)
    are read for their shape only and their labels set to IGNORE_INDEX."""

    def __init__(self, spec: EvalSpec, seq_len: int, seed: int, vocab_size: int, local_batch: int) -> None:
        assert spec.data is not None  # EvalSpec checks
        data = spec.data
        try:
            source = data_mod.build_source(data.kind, data.path, data.dtype, seq_len, seed, vocab_size)
        except SpecError as exc:
            # The sources name the training set's field; this one is the held-out set.
            raise SpecError(str(exc).replace("train.data", "eval.data")) from None
        self.loader = data_mod.DataLoader(source, local_batch, dp_rank=0, dp_degree=1)
        self.local_batch = local_batch
        if isinstance(source, data_mod.SyntheticTokens):
            assert spec.steps is not None  # EvalSpec checks
            self.samples = None  # no end: the rounds are spec.steps
        else:
            self.samples = len(source)
        self.max_rounds = spec.steps

    def n_batches(self, dp: int) -> int:
        if self.samples is None:
            assert self.max_rounds is not None
            return self.max_rounds * dp
        whole = -(-self.samples // self.local_batch)
        return whole if self.max_rounds is None else min(whole, self.max_rounds * dp)

    def batch(self, index: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Batch `index` (inputs, labels, positions: packed chat data's, else None); None: an empty batch
        (shaped as batch 0, nothing counted)."""
        self.loader.position = (index or 0) * self.local_batch
        try:
            inputs, labels, positions = self.loader.next_batch_with_positions()
        except SpecError as exc:
            raise SpecError(str(exc).replace("train.data", "eval.data")) from None
        first = (index or 0) * self.local_batch
        past = (
            self.local_batch
            if index is None
            else (0 if self.samples is None else max(0, first + self.local_batch - self.samples))
        )
        if past:
            labels = labels.clone()
            labels[self.local_batch - past :] = IGNORE_INDEX
        return inputs, labels, positions


class Evaluator:
    """Validates the trainer's model on the held-out set, in whatever layout the trainer built."""

    def __init__(self, trainer: Trainer, spec: EvalSpec) -> None:
        self.trainer, self.spec = trainer, spec
        cfg = trainer.cfg
        self.set = EvalSet(
            spec, cfg.model.seq_len, cfg.train.seed, trainer.model_cfg.vocab_size, cfg.train.local_batch_size
        )
        self.rounds = rank_rounds(
            self.set.n_batches(trainer.dims.dp), trainer.coords.dp_rank, trainer.dims.dp
        )

    def due(self, step: int) -> bool:
        every = self.spec.every
        return every is not None and (step % every == 0 or step == self.trainer.cfg.train.steps)

    def run(self) -> EvalResult:
        """Every rank calls this at the same step; every rank returns the same result."""
        t = self.trainer
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
        count = torch.zeros((), dtype=torch.float64, device=t.device)
        with _eval_mode(t.model_parts), torch.no_grad():
            for index in self.rounds:
                inputs, labels, positions = self.set.batch(index)
                # Packed conversations: positions restart at each, and attention stays inside each (as in training).
                extra = {"positions": positions.to(t.device)} if positions is not None else {}
                s, c = self._forward(inputs.to(t.device), labels.to(t.device), extra)
                loss_sum += s
                count += c
        # Only the last stage's first tp rank adds its data-parallel rank's share: the other tp ranks hold
        # the same numbers, and the other stages none.
        counts = t.is_last_stage and t.coords.tp_rank == 0
        totals = (
            torch.stack([loss_sum, count]) if counts else torch.zeros(2, dtype=torch.float64, device=t.device)
        )
        dist.all_reduce(totals)
        total_sum, total_count = (float(x) for x in totals.cpu())
        for _, moe in t.moe_blocks:
            moe.take_stats()  # validation's forwards are not the next step's expert load
            if t.schedule is not None:
                # Back in training, the schedule infers its shapes again with one forward (see Trainer).
                moe.skip_forwards = 1
        if total_count <= 0:
            raise SpecError(
                "eval.data: the held-out set has no token that counts (every label is masked): "
                "validate on a set with assistant tokens, or prepare it with train_on: all"
            )
        loss, perplexity = token_weighted_mean(total_sum, total_count)
        return EvalResult(
            t.step,
            loss,
            perplexity,
            int(total_count),
            self.set.n_batches(t.dims.dp),
            time.perf_counter() - start,
        )

    def _forward(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, count) of this rank's batch; zeros on ranks without the last stage."""
        t = self.trainer
        if t.schedule is None:
            with loss_parallel() if t.loss_parallel else contextlib.nullcontext():
                with t._autocast():
                    logits = t.module(inputs, **extra)
                s, c = masked_loss_sum(logits, labels)
            # A loss-parallel sum is a DTensor replicated over the tp group: every rank holds it whole.
            s = s.full_tensor() if isinstance(s, DTensor) else s
            return s.double(), c.double()
        counts: list[torch.Tensor] = []

        def summed(logits: torch.Tensor, mb_labels: torch.Tensor) -> torch.Tensor:
            s, c = masked_loss_sum(logits, mb_labels)
            counts.append(c)
            return s

        sums: list[torch.Tensor] = []
        args = (inputs,) if t.is_first_stage else ()
        kwargs = {"target": labels, "losses": sums} if t.is_last_stage else {}
        with _loss_fn(t.schedule, summed), t._autocast():
            t.schedule.eval(*args, return_outputs=False, **kwargs, **extra)
        if not sums:
            zero = torch.zeros((), dtype=torch.float64, device=t.device)
            return zero, zero
        return torch.stack(sums).double().sum(), torch.stack(counts).double().sum()


@contextlib.contextmanager
def _eval_mode(parts: list[torch.nn.Module]) -> Iterator[None]:
    """Dropout (LoRA's) off while validating; each module's own mode back afterwards."""
    modes = [(m, m.training) for part in parts for m in part.modules()]
    for part in parts:
        part.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def _loss_fn(schedule: Any, fn: Any) -> Iterator[None]:
    """The schedule's loss function swapped for validation's summed one. torch's schedules take theirs only
    in the constructor; building a second schedule over the same stages would set up their buffers and
    peer-to-peer channels again."""
    saved = schedule._loss_fn
    schedule._loss_fn = fn
    try:
        yield
    finally:
        schedule._loss_fn = saved
