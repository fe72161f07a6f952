"""nccl-tests' bandwidth formulas, so that our figures and nccl-tests' compare directly.

From nccl-tests doc/PERFORMANCE.md: algbw = S / t, and busbw = algbw × a per-collective factor that
makes the figure independent of the rank count n (comparable with a link's peak bandwidth):

    all_reduce      2(n-1)/n
    reduce_scatter  (n-1)/n
    all_gather      (n-1)/n
    all_to_all      (n-1)/n
    broadcast       1
    reduce          1

S is what nccl-tests prints in its `size` column: for all_reduce and broadcast the buffer each rank
holds; for all_gather and reduce_scatter the whole gathered (or to-be-scattered) array, n × the
per-rank chunk; for all_to_all each rank's whole send buffer (n × the per-peer chunk). Units follow
nccl-tests too: time in microseconds, bandwidth in GB/s with G = 1e9 (not GiB).
"""

from __future__ import annotations

from fractions import Fraction

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")


def bus_factor(op: str, ranks: int) -> Fraction:
    """busbw / algbw for `op` over `ranks` ranks, exact."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    n = ranks
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return Fraction(n - 1, n)
    if op in ("broadcast", "reduce"):
        return Fraction(1)
    raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(OPS)}")


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second), as nccl-tests prints it."""
    if seconds <= 0:
        raise ValueError(f"a time must be positive, not {seconds}")
    return size_bytes / seconds / 1e9


def busbw_gbps(op: str, size_bytes: int, seconds: float, ranks: int) -> float:
    return algbw_gbps(size_bytes, seconds) * float(bus_factor(op, ranks))
