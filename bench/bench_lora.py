"""LoRA's training step against full fine-tuning: the same model, layout, batch and optimizer settings.

Both trainers live in the same processes and step in alternation (one, the other, then the reverse), so that a
noisy machine slows both alike; the ratio of median step times is printed at the end (target: LoRA / full <= 0.7
on the 125M shape). With --checkpoint each also saves one checkpoint and the bytes of both are printed.

    torchrun --nproc-per-node 2 bench/bench_lora.py [--model 125M] [--seq-len 128] [--batch 1]
    python bench/bench_lora.py ...            (one process)

On CPU this uses gloo and fp32; on GPUs, NCCL and bf16 (and LoRA keeps the frozen base in bf16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="125M")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (every projection targeted)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round, each trainer")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--checkpoint", action="store_true", help="also save one checkpoint of each and compare bytes"
    )
    return p.parse_args()


def main() -> int:
    args = _parse()
    import torch.distributed as dist

    from hpkit.runtime.config import CheckpointSpec, RunConfig, resolve_mixed_precision
    from hpkit.runtime.env import distributed
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.runtime.run import quiet_known_warnings
    from hpkit.validation import parse_document

    quiet_known_warnings()
    with distributed() as job:
        world, rank = job.launch.world_size, job.launch.rank
        precision = resolve_mixed_precision("auto", job.device.type)

        def trainer(lora: bool) -> Trainer:
            model = {"name": args.model, "seq_len": args.seq_len}
            if lora:
                model["lora"] = {"rank": args.rank, "alpha": 2 * args.rank}
            cfg = parse_document(
                RunConfig,
                {
                    "parallelism": {"dp_shard": -1},
                    "model": model,
                    "train": {
                        "local_batch_size": args.batch,
                        "lr": 1e-4,
                        "grad_clip": 1.0,
                        "mixed_precision": precision,
                        "tensorboard": False,
                        "log_every": 10,
                        "stragglers": {"enabled": False},
                    },
                },
            )
            return Trainer(cfg, job.device)

        sides = {"full": trainer(False), "lora": trainer(True)}
        trainable = {
            name: sum(p.numel() for part in t.model_parts for p in part.parameters() if p.requires_grad)
            for name, t in sides.items()
        }
        for _ in range(args.warmup):
            for t in sides.values():
                t.train_step()
        times: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(args.rounds):
            for i in range(args.steps):
                for name in names if (r + i) % 2 == 0 else names[::-1]:
                    # CPU time of this process (all its threads, gloo's included): on a machine shared with
                    # other work the wall clock mostly measures the wait for a core; this measures the work.
                    start = time.process_time()
                    times[name].append(sides[name].train_step().step_time_s)
                    cpu[name].append(time.process_time() - start)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, cpu)
        # Per step, the CPU time of all ranks together.
        cpu = {
            name: [sum(rank_cpu[name][k] for rank_cpu in gathered) for k in range(len(cpu[name]))]
            for name in names
        }
        sizes: dict[str, int] = {}
        if args.checkpoint:
            sizes = _checkpoint_bytes(sides, rank, CheckpointSpec)
        if rank == 0:
            full, lora = statistics.median(times["full"]), statistics.median(times["lora"])
            print(
                f"model {args.model} seq {args.seq_len} batch {args.batch}/rank, "
                f"{sides['full'].dims.describe()} on {world} {job.device.type} rank(s), {precision}, "
                f"{args.rounds} rounds x {args.steps} steps each; "
                f"trainable parameters: full {trainable['full']:,}, LoRA rank {args.rank} {trainable['lora']:,}"
            )
            print(
                f"full step: median {full * 1000:.0f} ms ({', '.join(f'{t * 1000:.0f}' for t in times['full'])})"
            )
            print(
                f"LoRA step: median {lora * 1000:.0f} ms ({', '.join(f'{t * 1000:.0f}' for t in times['lora'])})"
            )
            print(f"RATIO lora/full step time = {lora / full:.3f} (target <= 0.7)")
            cpu_full, cpu_lora = statistics.median(cpu["full"]), statistics.median(cpu["lora"])
            print(
                f"CPU time per step, all ranks: full median {cpu_full * 1000:.0f} ms "
                f"({', '.join(f'{t * 1000:.0f}' for t in cpu['full'])}), LoRA median {cpu_lora * 1000:.0f} ms "
                f"({', '.join(f'{t * 1000:.0f}' for t in cpu['lora'])})"
            )
            print(f"RATIO lora/full CPU time per step = {cpu_lora / cpu_full:.3f} (target <= 0.7)")
            if sizes:
                print(
                    f"checkpoint bytes: full {sizes['full']:,}, LoRA {sizes['lora']:,}, "
                    f"LoRA / full {sizes['lora'] / sizes['full']:.4f} (target <= 0.05)"
                )
        for t in sides.values():
            t.close()
        dist.barrier()
    return 0


def _checkpoint_bytes(sides: dict, rank: int, spec_cls) -> dict[str, int]:
    import torch.distributed as dist

    from hpkit.runtime.checkpoints.checkpoint import Checkpointer
    from hpkit.runtime.checkpoints.checkpoint_record import read_record

    sizes = {}
    holder = [tempfile.mkdtemp(prefix="bench-lora-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    for name, t in sides.items():
        root = Path(holder[0]) / name
        ckpt = Checkpointer(spec_cls(dir=str(root)), root, rank, model=t.model_record())
        start = time.perf_counter()
        ckpt.save(t.step, t.checkpoint_state(), final=True)
        ckpt.close()
        if rank == 0:
            sizes[name] = read_record(ckpt.latest()).total_bytes
            print(
                f"{name} checkpoint: {sizes[name]:,} bytes in {time.perf_counter() - start:.1f} s", flush=True
            )
    if rank == 0:
        import shutil

        shutil.rmtree(holder[0], ignore_errors=True)
    return sizes


if __name__ == "__main__":
    sys.exit(main())
