"""Time torch.distributed collectives over a sweep of sizes.

Runs in whatever process group the launch gives it (torchrun, srun, or one process), on the backend
the device implies (nccl on GPUs, gloo on CPUs), and reports nccl-tests' time/algbw/busbw so that a
figure here and one from all_reduce_perf mean the same thing. Like nccl-tests, each size is timed as
`iters` back-to-back operations after `warmup` untimed ones, the time is the mean over ranks
(nccl-tests' default `-a 1`), and each result is checked once against the values it must hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from hpkit.errors import HpkitError
from hpkit.netbench.bandwidth import OPS, algbw_gbps, busbw_gbps
from hpkit.netbench.results import BenchRow

DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}


@dataclass(frozen=True)
class SweepConfig:
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    dtype: str  # nccl-tests' name: float, half, bfloat16, double
    check: bool


@dataclass
class Buffers:
    """One collective at one size: its tensors, how to run it, and what every rank must end up with."""

    size_bytes: int  # nccl-tests' S
    count: int  # nccl-tests' count column
    run: Callable[[], None]
    settle: Callable[[], None]  # after the check: inputs that stay finite however often an in-place op runs
    wrong: Callable[[], int]  # elements that differ from the expected result on this rank


def _noop() -> None:
    pass


def _all_gather(out, inp, group=None) -> None:
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor; clusters may run an older torch.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out, inp, group=None) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _elements(op: str, size: int, itemsize: int, n: int) -> tuple[int, int]:
    """(elements per rank-level argument, nccl-tests count column) for a requested size in bytes.

    Sizes that do not split evenly are rounded down to whole elements (and whole per-rank chunks),
    as nccl-tests does; at least one element per chunk, so that the smallest sizes still move data.
    """
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        chunk = max(1, size // (itemsize * n))
        return chunk, chunk
    count = max(1, size // itemsize)
    return count, count


def make_buffers(op: str, size: int, dtype, device, rank: int, n: int, group=None) -> Buffers:
    """rank and n are within `group` (None: the whole process group)."""
    import torch
    import torch.distributed as dist

    # broadcast and reduce name their root by global rank.
    root = dist.get_global_rank(group, 0) if group is not None else 0

    itemsize = torch.empty((), dtype=dtype).element_size()
    elems, count = _elements(op, size, itemsize, n)

    def full(numel: int, value: float):
        return torch.full((numel,), float(value), dtype=dtype, device=device)

    def mismatches(tensor, expected) -> int:
        return int((tensor != expected).sum().item())

    if op == "all_reduce":
        buf = full(elems, rank + 1)
        expected = n * (n + 1) / 2

        return Buffers(
            elems * itemsize,
            count,
            lambda: dist.all_reduce(buf, group=group),
            buf.zero_,
            lambda: mismatches(buf, expected),
        )
    if op == "broadcast":
        buf = full(elems, 1 if rank == 0 else 0)

        return Buffers(
            elems * itemsize,
            count,
            lambda: dist.broadcast(buf, src=root, group=group),
            _noop,
            lambda: mismatches(buf, 1),
        )
    if op == "reduce":
        buf = full(elems, rank + 1)

        def wrong() -> int:
            return mismatches(buf, n * (n + 1) / 2) if rank == 0 else 0

        return Buffers(
            elems * itemsize, count, lambda: dist.reduce(buf, dst=root, group=group), buf.zero_, wrong
        )
    if op == "all_gather":
        inp = full(elems, rank)
        out = full(elems * n, -1)
        expected = torch.arange(n, dtype=dtype, device=device).repeat_interleave(elems)
        return Buffers(
            elems * n * itemsize,
            count,
            lambda: _all_gather(out, inp, group),
            _noop,
            lambda: mismatches(out, expected),
        )
    if op == "reduce_scatter":
        inp = full(elems * n, rank + 1)
        out = full(elems, -1)
        return Buffers(
            elems * n * itemsize,
            count,
            lambda: _reduce_scatter(out, inp, group),
            _noop,
            lambda: mismatches(out, n * (n + 1) / 2),
        )
    if op == "all_to_all":
        # Chunk j of rank r holds r*n + j; after the exchange chunk j of rank r holds j*n + r.
        inp = (rank * n + torch.arange(n, device=device)).to(dtype).repeat_interleave(elems)
        out = full(elems * n, -1)
        expected = (torch.arange(n, device=device) * n + rank).to(dtype).repeat_interleave(elems)
        return Buffers(
            elems * n * itemsize,
            count,
            lambda: dist.all_to_all_single(out, inp, group=group),
            _noop,
            lambda: mismatches(out, expected),
        )
    raise HpkitError(f"unknown collective {op!r}: choose from {', '.join(OPS)}")


def measure(cfg: SweepConfig, device, backend: str, group=None) -> list[BenchRow]:
    """Run the sweep on the initialised process group, or on `group` (a subgroup: its members only, while
    other subgroups run their own); every member returns the same rows."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    dtype = getattr(torch, DTYPES[cfg.dtype])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[BenchRow] = []
    for op in cfg.ops:
        for size in cfg.sizes:
            bufs = make_buffers(op, size, dtype, device, rank, n, group)
            wrong = None
            if cfg.check:
                bufs.run()
                sync()
                wrong = bufs.wrong()
                bufs.settle()
            for _ in range(cfg.warmup):
                bufs.run()
            sync()
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(cfg.iters):
                bufs.run()
            sync()
            elapsed = (time.perf_counter() - start) / cfg.iters
            # One reduction carries the mean time and the total of wrong elements over all ranks.
            packed = torch.tensor([elapsed, float(wrong or 0)], dtype=torch.float64, device=device)
            dist.all_reduce(packed, group=group)
            seconds = packed[0].item() / n
            rows.append(
                BenchRow(
                    source="hpkit",
                    op=op,
                    ranks=n,
                    size_bytes=bufs.size_bytes,
                    count=bufs.count,
                    dtype=cfg.dtype,
                    in_place=op in ("all_reduce", "broadcast", "reduce"),
                    time_us=seconds * 1e6,
                    algbw_gbps=algbw_gbps(bufs.size_bytes, seconds),
                    busbw_gbps=busbw_gbps(op, bufs.size_bytes, seconds, n),
                    wrong=int(packed[1].item()) if cfg.check else None,
                    backend=backend,
                )
            )
    return rows
