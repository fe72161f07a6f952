"""hpkit's training step against a bare, hand-written FSDP2 loop: same model, mesh, batch and optimizer.

Both run in the same processes, in alternating rounds, so that a noisy machine slows both alike;
the ratio of median step times is printed at the end (target: hpkit / bare <= 1.02).

    torchrun --nproc-per-node 2 bench/bench_train_step.py [--model debug] [--seq-len 256] [--batch 4]

With --monitoring, the same way: hpkit's step with straggler detection and a Prometheus textfile (and the
reporting that goes with them) against hpkit's step with neither (target: on / off <= 1.02).

On CPU this uses gloo and fp32; on GPUs, NCCL and bf16 (FSDP2's mixed precision in both loops).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="debug")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round, each loop")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--monitoring",
        action="store_true",
        help="compare hpkit with stragglers + Prometheus on against off (instead of against a bare loop)",
    )
    p.add_argument("--log-every", type=int, default=10, help="logging steps (Prometheus writes) every N")
    p.add_argument("--straggler-every", type=int, default=10, help="straggler window, steps (--monitoring)")
    return p.parse_args()


def main() -> int:
    args = _parse()
    from hpkit.runtime.env import distributed
    from hpkit.runtime.run import quiet_known_warnings

    quiet_known_warnings()
    with distributed() as job:
        if args.monitoring:
            _compare_monitoring(args, job.device)
        else:
            _compare(args, job.device)
    return 0


def _compare(args: argparse.Namespace, device_info) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from hpkit.models.llama.model import build_model
    from hpkit.runtime.config import RunConfig, resolve_mixed_precision
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.runtime.parallel.fsdp import mixed_precision_policy
    from hpkit.validation import parse_document

    world, rank = dist.get_world_size(), dist.get_rank()
    precision = resolve_mixed_precision("auto", device_info.type)
    cfg = parse_document(
        RunConfig,
        {
            "parallelism": {"dp_shard": -1},
            "model": {"name": args.model, "seq_len": args.seq_len},
            "train": {
                "local_batch_size": args.batch,
                "lr": 1e-4,
                "grad_clip": 1.0,
                "mixed_precision": precision,
                "tensorboard": False,
                # The host reads the loss and grad norm on logging steps only (torchtitan logs every 10).
                "log_every": args.log_every,
            },
        },
    )
    hp = Trainer(cfg, device_info)
    device = hp.device

    # The bare loop: what someone writes by hand from the FSDP2 tutorial, on the same mesh.
    mesh = hp.coords.fsdp_mesh
    bare = build_model(hp.model_cfg, "meta")
    mp = mixed_precision_policy(precision)
    for block in bare.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(bare, mesh=mesh, mp_policy=mp)
    bare.to_empty(device=device)
    bare.init_weights(0)
    opt = torch.optim.AdamW(bare.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    vocab = hp.model_cfg.vocab_size

    def bare_step() -> float:
        start = time.perf_counter()
        rows = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
        logits = bare(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # a hand-written loop reads the loss to print it
        return time.perf_counter() - start

    def hp_step() -> float:
        return hp.train_step().step_time_s

    times = _alternate(args, ("hpkit", hp_step), ("bare", bare_step))
    if rank == 0:
        print(
            f"model {args.model} seq {args.seq_len} batch {args.batch}/rank, FSDP2 over {world} "
            f"{device_info.type} rank(s), {precision}, {args.rounds} rounds x {args.steps} steps each"
        )
        _print(times, args.batch * args.seq_len * world, "hpkit/bare")


def _alternate(args: argparse.Namespace, first, second) -> dict[str, list[float]]:
    for _ in range(args.warmup):
        first[1]()
        second[1]()
    times: dict[str, list[float]] = {first[0]: [], second[0]: []}
    for r in range(args.rounds):
        # Step by step in alternation (first one, then the other, then the reverse), so that load from
        # other processes on a shared machine falls on both loops alike.
        order = [first, second]
        for i in range(args.steps):
            for name, fn in order if (r + i) % 2 == 0 else order[::-1]:
                times[name].append(fn())
    return times


def _print(times: dict[str, list[float]], tokens: int, label: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, values in times.items():
        print(
            f"  {name:<6} median step {med[name] * 1000:8.2f} ms (best {min(values) * 1000:8.2f} ms)  "
            f"{tokens / med[name]:10,.0f} tokens/s"
        )
    a, b = times
    ratio = med[a] / med[b]
    verdict = "ok" if ratio <= 1.02 else "ABOVE TARGET"
    print(f"ratio {label} = {ratio:.3f} (target <= 1.02: {verdict})")


def _compare_monitoring(args: argparse.Namespace, device_info) -> None:
    """Two hpkit Trainers alike but for stragglers + Prometheus; each step timed with its reporting."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from hpkit.runtime.config import RunConfig, resolve_mixed_precision
    from hpkit.runtime.env import node_name
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.runtime.observe.metrics import MetricsLogger
    from hpkit.runtime.observe.prometheus import PrometheusExporter
    from hpkit.runtime.observe.report import StepReporter
    from hpkit.validation import parse_document

    world, rank = dist.get_world_size(), dist.get_rank()
    precision = resolve_mixed_precision("auto", device_info.type)
    textfiles = tempfile.mkdtemp(prefix="hpkit-bench-prom-")

    def config(on: bool):
        return parse_document(
            RunConfig,
            {
                "parallelism": {"dp_shard": -1},
                "model": {"name": args.model, "seq_len": args.seq_len},
                "train": {
                    "local_batch_size": args.batch,
                    "lr": 1e-4,
                    "mixed_precision": precision,
                    "tensorboard": False,
                    "log_every": args.log_every,
                    "stragglers": {"enabled": on, "every_steps": args.straggler_every},
                    "prometheus": {"textfile_dir": textfiles} if on else None,
                },
            },
        )

    def stepper(on: bool):
        cfg = config(on)
        trainer = Trainer(cfg, device_info)
        exporter = (
            PrometheusExporter(cfg.train.prometheus, "bench", "bench", rank, rank, node_name())
            if on
            else None
        )
        # No console or JSONL in either: the comparison is about what the two features add.
        quiet = MetricsLogger(enabled=False, jsonl_path=None, tensorboard_dir=None)
        report = StepReporter(trainer, quiet, exporter, None, lambda line: None)

        reporting: list[float] = []

        def step() -> float:
            start = time.perf_counter()
            result = trainer.train_step()
            mid = time.perf_counter()
            report.step(result)
            end = time.perf_counter()
            reporting.append(end - mid)
            return end - start

        return step, report, reporting

    on_step, on_report, on_reporting = stepper(True)
    off_step, off_report, _ = stepper(False)
    times = _alternate(args, ("on", on_step), ("off", off_step))
    on_report.close()
    off_report.close()
    shutil.rmtree(textfiles, ignore_errors=True)
    if rank == 0:
        print(
            f"model {args.model} seq {args.seq_len} batch {args.batch}/rank, FSDP2 over {world} "
            f"{device_info.type} rank(s), {precision}, {args.rounds} rounds x {args.steps} steps each; "
            f"on: stragglers every {args.straggler_every} steps + Prometheus textfile every {args.log_every}"
        )
        _print(times, args.batch * args.seq_len * world, "on/off")
        # The direct cost, free of the noise between two medians: the reporting after each step (Prometheus
        # writes, straggler verdicts); the timers and the all-gather inside the step cost microseconds.
        logged = sorted(on_reporting)
        print(
            f"  on: reporting after the step, mean {statistics.mean(logged) * 1000:.3f} ms, "
            f"max {logged[-1] * 1000:.3f} ms over {len(logged)} steps"
        )


if __name__ == "__main__":
    sys.exit(main())
