"""The divisibility rules of tensor and expert parallel: what a degree must divide for the runtime to shard
a model. The runtime raises their lines (hpkit.models.adapters, hpkit.runtime.parallel.expert_parallel, the spec's
validators) and the planner rejects layouts with them (hpkit.plan.search): one rule, one wording.
"""

from __future__ import annotations


def tp_problem(
    tp: int,
    *,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    seq_len: int,
    whole_model: bool = True,
    sequence_parallel: bool = False,
) -> str | None:
    """Every dimension of a Llama-style decoder that `tp` does not divide, in one line; None when it divides all.

    Heads and the FFN are split by column/row parallel; under whole-model TP the embeddings and the head are
    split over the vocabulary, and sequence parallel splits the sequence."""
    problems = []
    if n_heads % tp:
        problems.append(f"n_heads={n_heads}")
    if n_kv_heads % tp:
        problems.append(f"n_kv_heads={n_kv_heads}")
    if ffn_dim % tp:
        problems.append(f"ffn_dim={ffn_dim}")
    if whole_model and sequence_parallel and seq_len % tp:
        problems.append(f"seq_len={seq_len} (sequence parallel splits it)")
    if whole_model and vocab_size % tp:
        problems.append(f"vocab_size={vocab_size}")
    return f"parallelism.tp={tp} must divide {', '.join(problems)}" if problems else None


def ep_problem(ep: int, experts: int) -> str | None:
    """Why `ep` ranks cannot split `experts` routed experts evenly, or None."""
    if experts % ep:
        return f"parallelism.ep={ep} must divide model.moe.experts={experts}: each ep rank holds experts / ep of them"
    return None
