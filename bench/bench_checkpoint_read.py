"""How fast a rank loads its checkpoint back: DCP's reader (one thread) against hpkit's ParallelReader (READ_THREADS),
side by side in one run, on the runtime's own load path (checkpoint.load_into, which both tiers use).

A Trainer's whole state (model, AdamW, RNG and loader states) is saved once with DCP into node memory (/dev/shm,
as the in-memory tier keeps it) and, with --disk, into a folder on disk (page cache warm after the first read);
then loads alternate between the two readers, --rounds of each, into the live state, and the medians are printed
with the ratio. On a GPU the state is the CUDA state, so the copy to the device is in the figure.

    python3 bench/bench_checkpoint_read.py [--model 125M] [--rounds 5] [--disk DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="125M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--disk", help="also a folder on disk")
    args = p.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    from hpkit.runtime.checkpoints import checkpoint
    from hpkit.runtime.config import ModelSpec, ParallelismSpec, RunConfig, TrainSpec
    from hpkit.runtime.env import distributed
    from hpkit.runtime.loop.trainer import Trainer

    places = [Path("/dev/shm") / f"hpkit-read-bench-{os.getpid()}"]
    if args.disk:
        places.append(Path(args.disk) / f"hpkit-read-bench-{os.getpid()}")
    with distributed() as job:
        gpu = job.device.type == "cuda"
        cfg = RunConfig(
            name="read-bench",
            output_dir=str(places[0] / "out"),
            parallelism=ParallelismSpec(dp_shard=1),
            model=ModelSpec(name=args.model, seq_len=2048 if gpu else 64),
            train=TrainSpec(local_batch_size=1, tensorboard=False, mixed_precision="bf16" if gpu else "fp32"),
        )
        trainer = Trainer(cfg, job.device)
        try:
            trainer.train_step()
            checkpoint.skip_zip_crc32()
            print(
                f"bench_checkpoint_read: {torch.cuda.get_device_name() if gpu else 'cpu'}, model {args.model}, "
                f"READ_THREADS {checkpoint.READ_THREADS}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
            )
            for place in places:
                folder = place / "step"
                dcp.save(
                    trainer.checkpoint_state(), storage_writer=dcp.FileSystemWriter(folder, thread_count=1)
                )
                size = sum(f.stat().st_size for f in folder.iterdir())
                times: dict[int, list[float]] = {1: [], checkpoint.READ_THREADS: []}
                threads = checkpoint.READ_THREADS
                for i in range(2 * args.rounds):
                    side = (1, threads)[(i + i // 2) % 2]  # 1, T, T, 1, 1, T, ...
                    checkpoint.READ_THREADS = side
                    state = trainer.checkpoint_state()
                    if gpu:
                        torch.cuda.synchronize()
                    began = time.perf_counter()
                    checkpoint.load_into(state, state, folder, None)
                    if gpu:
                        torch.cuda.synchronize()
                    times[side].append(time.perf_counter() - began)
                checkpoint.READ_THREADS = threads
                one, many = statistics.median(times[1]), statistics.median(times[threads])
                print(
                    f"  {place.parent}: {size / 2**30:.2f} GiB; one thread {one:.2f} s ({size / one / 1e9:.2f} GB/s), "
                    f"{threads} threads {many:.2f} s ({size / many / 1e9:.2f} GB/s): ratio {many / one:.3f} "
                    f"(rounds: {', '.join(f'{t:.2f}' for t in times[1])} / {', '.join(f'{t:.2f}' for t in times[threads])})"
                )
        finally:
            trainer.close()
            for place in places:
                shutil.rmtree(place, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
