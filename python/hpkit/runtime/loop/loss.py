"""The training loss: cross-entropy over the tokens that count, as a token-weighted mean over the whole step.

A label of IGNORE_INDEX (chat data's prompts, padding) does not count. The step's loss is the sum over
every counted token of every microbatch and data-parallel rank, divided by their global count: a mean of
per-batch means would weigh a token of a short answer more than one of a long answer.

How the gradient comes out right: FSDP and DDP average gradients over the `dp` data-parallel ranks, and
the pipeline schedule sums its microbatches' gradients (scale_grads off). So each rank's loss is its own
sum over `divisor` = global count / dp; averaged over dp ranks that is the gradient of sum / global count.
Without a mask the count is known without a collective (every label counts): the divisor is then the
local number of tokens, and the loss is exactly today's `F.cross_entropy(..., reduction="mean")`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Labels of tokens that do not count (the value torch's and transformers' losses skip).
IGNORE_INDEX = -100


def masked_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 cross-entropy summed over the counted tokens, their count). logits [..., vocab], labels [...].

    Under loss parallel `logits` is a vocabulary-sharded DTensor and the sum a replicated DTensor."""
    loss_sum = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (labels != IGNORE_INDEX).sum()


class TokenWeightedLoss:
    """The per-microbatch loss function of one step: its counted sum / (global count / dp).

    `begin_step(labels)` is called with the rank's whole local batch before any forward; it finds the
    divisor (a device tensor when labels are masked: no host sync) on every rank alike."""

    def __init__(self, dp: int, masked: bool) -> None:
        self.dp, self.masked = dp, masked
        self.divisor: torch.Tensor | float = 1.0

    def begin_step(self, labels: torch.Tensor) -> None:
        if not self.masked:
            self.divisor = float(labels.numel())
            return
        count = (labels != IGNORE_INDEX).sum()
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Every rank of one data-parallel replica holds the same labels, so the sum over all ranks is
        # the global count times world / dp: divided by the world size it is the divisor global / dp.
        if world > 1:
            dist.all_reduce(count)
        # A step whose tokens all do not count has loss 0 (and no gradient), not 0/0.
        self.divisor = (count.double() / world).clamp(min=1.0 / self.dp).float()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, _ = masked_loss_sum(logits, labels)
        return loss_sum / self.divisor
