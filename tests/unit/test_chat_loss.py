"""The loss contract (hpkit.runtime.loop.loss): counted sums, and a token-weighted mean that equals today's
mean when nothing is masked, over data-parallel ranks too (two real gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _gloo import run_ranks

from hpkit.runtime.loop.loss import IGNORE_INDEX, TokenWeightedLoss, masked_loss_sum


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 7, 11, generator=gen), torch.randint(0, 11, (3, 7), generator=gen)


def test_sum_and_count_skip_ignored_labels():
    logits, labels = _batch()
    labels[0, :4] = IGNORE_INDEX
    labels[2, 6] = IGNORE_INDEX
    loss_sum, count = masked_loss_sum(logits, labels)
    keep = labels != IGNORE_INDEX
    per_token = F.cross_entropy(logits[keep], labels[keep], reduction="none")
    assert int(count) == int(keep.sum()) == 21 - 5
    torch.testing.assert_close(loss_sum, per_token.sum())
    assert loss_sum.dtype == torch.float32


def test_unmasked_loss_equals_the_plain_mean():
    logits, labels = _batch(1)
    loss = TokenWeightedLoss(dp=1, masked=False)
    loss.begin_step(labels)
    assert float(loss(logits, labels)) == float(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_masked_loss_is_a_mean_over_counted_tokens_not_of_microbatch_means():
    logits, labels = _batch(2)
    labels[0, 1:] = IGNORE_INDEX  # microbatch 0 counts 1 token, the others 7 each
    loss = TokenWeightedLoss(dp=1, masked=True)
    loss.begin_step(labels)
    # Microbatches add up (the pipeline's scale_grads is off): their sum is the mean over all 15 tokens.
    total = sum(loss(logits[i : i + 1], labels[i : i + 1]) for i in range(3))
    keep = labels != IGNORE_INDEX
    expected = F.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(total, expected)
    per_batch_means = torch.stack([F.cross_entropy(logits[i][keep[i]], labels[i][keep[i]]) for i in range(3)])
    assert abs(float(per_batch_means.mean()) - float(expected)) > 1e-3, "the test must tell the two apart"


def test_a_step_with_nothing_counted_has_zero_loss():
    logits, labels = _batch(3)
    labels[:] = IGNORE_INDEX
    loss = TokenWeightedLoss(dp=2, masked=True)
    loss.begin_step(labels)
    assert float(loss(logits, labels)) == 0.0


def _rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `rank`'s batch: rank 0 counts 3 tokens, rank 1 counts 9 (of 14 each)."""
    logits, labels = _batch(10 + rank)
    labels = labels[:2]
    labels.view(-1)[3 if rank == 0 else 9 :] = IGNORE_INDEX
    return logits[:2], labels


def _loss_over_ranks(rank: int, world: int) -> None:
    # Two data-parallel ranks (dp 2): each divides its own sum by the global count / dp = (3 + 9) / 2, so that
    # the average of their losses (what DDP and FSDP average the gradients of) is the mean over all 12 tokens.
    # A rank that divided by its own count would weigh rank 0's 3 tokens as much as rank 1's 9.
    logits, labels = _rank_batch(rank)
    loss = TokenWeightedLoss(dp=2, masked=True)
    loss.begin_step(labels)
    assert float(loss.divisor) == 6.0, (rank, loss.divisor)
    mine = loss(logits, labels)
    total = mine.detach().clone()
    dist.all_reduce(total)
    both = [_rank_batch(r) for r in range(world)]
    every_logit = torch.cat([lg for lg, _ in both]).flatten(0, 1)
    every_label = torch.cat([lb for _, lb in both]).flatten()
    torch.testing.assert_close(
        total / 2, F.cross_entropy(every_logit, every_label, ignore_index=IGNORE_INDEX)
    )
    # One data-parallel rank over two tensor-parallel ranks (dp 1): both hold the same labels, and each divides
    # by their count once (not by twice it, which the sum over the world is).
    loss = TokenWeightedLoss(dp=1, masked=True)
    loss.begin_step(both[1][1])
    assert float(loss.divisor) == 9.0, (rank, loss.divisor)


def test_the_divisor_is_the_global_count_over_data_parallel_ranks(tmp_path):
    run_ranks(_loss_over_ranks, 2, tmp_path)
