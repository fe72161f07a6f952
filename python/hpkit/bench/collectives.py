"""`hpkit bench collectives`: time torch.distributed collectives over a sweep of sizes.

Runs in whatever process group the launch gives it (torchrun, srun, or one process), on the backend
the device implies (nccl on GPUs, gloo on CPUs), and reports nccl-tests' time/algbw/busbw so that a
figure here and one from all_reduce_perf mean the same thing. Like nccl-tests, each size is timed as
`iters` back-to-back operations after `warmup` untimed ones, the time is the mean over ranks
(nccl-tests' default `-a 1`), and each result is checked once against the values it must hold.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpkit.bench.bandwidth import OPS, algbw_gbps, busbw_gbps
from hpkit.bench.results import BenchRow, table, write_outputs
from hpkit.bench.sizes import parse_size, sweep
from hpkit.errors import HpkitError

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


def _all_gather(out, inp) -> None:
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor; clusters may run an older torch.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def _reduce_scatter(out, inp) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp)


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


def make_buffers(op: str, size: int, dtype, device, rank: int, n: int) -> Buffers:
    import torch
    import torch.distributed as dist

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
            lambda: dist.all_reduce(buf),
            buf.zero_,
            lambda: mismatches(buf, expected),
        )
    if op == "broadcast":
        buf = full(elems, 1 if rank == 0 else 0)

        return Buffers(
            elems * itemsize, count, lambda: dist.broadcast(buf, src=0), _noop, lambda: mismatches(buf, 1)
        )
    if op == "reduce":
        buf = full(elems, rank + 1)

        def wrong() -> int:
            return mismatches(buf, n * (n + 1) / 2) if rank == 0 else 0

        return Buffers(elems * itemsize, count, lambda: dist.reduce(buf, dst=0), buf.zero_, wrong)
    if op == "all_gather":
        inp = full(elems, rank)
        out = full(elems * n, -1)
        expected = torch.arange(n, dtype=dtype, device=device).repeat_interleave(elems)
        return Buffers(
            elems * n * itemsize,
            count,
            lambda: _all_gather(out, inp),
            _noop,
            lambda: mismatches(out, expected),
        )
    if op == "reduce_scatter":
        inp = full(elems * n, rank + 1)
        out = full(elems, -1)
        return Buffers(
            elems * n * itemsize,
            count,
            lambda: _reduce_scatter(out, inp),
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
            lambda: dist.all_to_all_single(out, inp),
            _noop,
            lambda: mismatches(out, expected),
        )
    raise HpkitError(f"unknown collective {op!r}: choose from {', '.join(OPS)}")


def measure(cfg: SweepConfig, device, backend: str) -> list[BenchRow]:
    """Run the sweep on the initialised process group; every rank returns the same rows."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, DTYPES[cfg.dtype])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[BenchRow] = []
    for op in cfg.ops:
        for size in cfg.sizes:
            bufs = make_buffers(op, size, dtype, device, rank, n)
            wrong = None
            if cfg.check:
                bufs.run()
                sync()
                wrong = bufs.wrong()
                bufs.settle()
            for _ in range(cfg.warmup):
                bufs.run()
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(cfg.iters):
                bufs.run()
            sync()
            elapsed = (time.perf_counter() - start) / cfg.iters
            # One reduction carries the mean time and the total of wrong elements over all ranks.
            packed = torch.tensor([elapsed, float(wrong or 0)], dtype=torch.float64, device=device)
            dist.all_reduce(packed)
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown collective(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(OPS)}"
        )
    return ops


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time collectives over a sweep of sizes and report time, algbw and busbw as nccl-tests "
        "does. Launch it with torchrun or srun (one process per rank), or in a Slurm job: "
        "slurm/jobs/collectives.yaml.",
    )
    parser.add_argument(
        "--ops", type=_ops, default=DEFAULT_OPS, help=f"comma-separated (default: {','.join(DEFAULT_OPS)})"
    )
    parser.add_argument(
        "-b", "--min-bytes", type=_size, default=parse_size("8"), help="smallest size (default 8)"
    )
    parser.add_argument(
        "-e", "--max-bytes", type=_size, default=parse_size("64M"), help="largest (default 64M)"
    )
    parser.add_argument("-f", "--factor", type=_positive_int, default=2, help="size step factor (default 2)")
    parser.add_argument("-n", "--iters", type=_positive_int, default=20, help="timed iterations (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float", help="element type")
    parser.add_argument("--no-check", action="store_true", help="skip checking each result's values")
    parser.add_argument("--csv", help="also write the rows as CSV here (rank 0)")
    parser.add_argument("--json", help="also write the rows as JSON here (rank 0)")
    return parser


def parse_config(argv: list[str], prog: str) -> tuple[SweepConfig, argparse.Namespace]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("argument -w/--warmup: must be 0 or more")
    try:
        sizes = sweep(args.min_bytes, args.max_bytes, args.factor)
    except ValueError as exc:
        parser.error(f"argument -b/-e/-f: {exc}")
    cfg = SweepConfig(args.ops, tuple(sizes), args.iters, args.warmup, args.dtype, not args.no_check)
    return cfg, args


def main(argv: list[str], prog: str = "hpkit bench collectives") -> int:
    cfg, args = parse_config(argv, prog)
    from hpkit.runtime.env import choose_device, configure_threads, init_distributed, read_launch_env

    launch = read_launch_env()
    configure_threads(launch)
    device = choose_device(launch)
    init_distributed(launch, device)
    import torch.distributed as dist

    try:
        rows = measure(cfg, device.torch_device(), device.backend)
        if launch.is_rank0:
            print(
                f"# hpkit bench collectives: {launch.world_size} rank(s), backend {device.backend}, "
                f"device {device.type}, dtype {cfg.dtype}, iters {cfg.iters}, warmup {cfg.warmup}"
            )
            sys.stdout.write(table(rows))
            for op in cfg.ops:
                busbw = [r.busbw_gbps for r in rows if r.op == op]
                print(f"# Avg bus bandwidth {op:<15}: {sum(busbw) / len(busbw):.6f} GB/s")
            write_outputs(rows, args.csv, args.json)
            sys.stdout.flush()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    bad = sum(r.wrong or 0 for r in rows)
    if bad:
        if launch.is_rank0:
            print(
                f"# hpkit bench collectives: {bad} wrong element(s): the collectives returned bad data",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:], prog="python -m hpkit.bench.collectives"))
    except HpkitError as exc:
        print(f"hpkit bench collectives: error: {exc}", file=sys.stderr)
        sys.exit(1)
