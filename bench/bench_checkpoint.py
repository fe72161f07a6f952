"""Distributed checkpoint speed: DCP save throughput vs `dd` to the same directory, and async vs sync stall.

Runs the runtime's own Trainer and Checkpointer (FSDP2 over all ranks, model + AdamW state) and, in
alternating rounds so that a noisy machine slows both alike:
  1. a sync DCP save vs `dd if=/dev/zero bs=1M conv=fsync` of the same byte count (rank 0, while the
     others wait): throughput ratio, target >= 0.7;
  2. training with saves, alternating an async and a sync Checkpointer: the time the loop is blocked
     per save (for async: the call, the next optimizer steps' waits for the copy to host memory, and
     waiting for the write to finish before the next save), target async / sync <= 0.1.

    torchrun --nproc-per-node 2 bench/bench_checkpoint.py [--dir /tmp/hpkit-bench/ckpt]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpkit-bench-ckpt"))
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--interval", type=int, default=2, help="training steps between saves")
    return p.parse_args()


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed_steps(trainer, n: int, checkpointer=None) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.train_step(checkpointer)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    args = _parse()
    from hpkit.runtime.env import distributed

    with distributed() as job:
        _measure(args, job.launch, job.device)
    return 0


def _measure(args: argparse.Namespace, launch, device) -> None:
    import torch.distributed as dist

    from hpkit.runtime.checkpoint import Checkpointer, committed
    from hpkit.runtime.config import CheckpointSpec, ModelSpec, ParallelismSpec, RunConfig, TrainSpec
    from hpkit.runtime.trainer import Trainer

    rank0 = launch.rank == 0
    root = Path(args.dir)
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    cfg = RunConfig(
        name="ckpt-bench",
        output_dir=str(root / "logs"),
        parallelism=ParallelismSpec(dp_shard=-1),
        model=ModelSpec(
            name="debug", dim=args.dim, n_layers=args.layers, ffn_dim=args.dim * 8 // 3, seq_len=64
        ),
        train=TrainSpec(local_batch_size=1, tensorboard=False),
    )
    sync_ck = Checkpointer(CheckpointSpec(keep=1), root / "sync", launch.rank)
    async_ck = Checkpointer(CheckpointSpec(keep=1, async_save=True), root / "async", launch.rank)
    trainer = Trainer(cfg, device)
    current = [sync_ck]

    def save() -> None:
        current[0].save(trainer.step, trainer.checkpoint_state(), forced=True)

    trainer.train_step()  # optimizer state exists from here on, as in a real checkpoint

    # 1. throughput: sync DCP save vs dd of the same bytes, alternating which goes first.
    dcp_bps, dd_bps, nbytes = [], [], 0
    for i in range(args.rounds):
        for which in ("dcp", "dd") if i % 2 == 0 else ("dd", "dcp"):
            dist.barrier()
            start = time.perf_counter()
            if which == "dcp":
                current[0] = sync_ck
                save()
                seconds = time.perf_counter() - start
                nbytes = _du(committed(root / "sync")[-1][1])
                dcp_bps.append(nbytes / seconds)
            else:
                if rank0:
                    target = root / "dd.bin"
                    count = max(1, nbytes // 2**20) if nbytes else 512
                    subprocess.run(
                        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fsync"],
                        check=True, capture_output=True,
                    )  # fmt: skip
                    seconds = time.perf_counter() - start
                    dd_bps.append(count * 2**20 / seconds)
                    target.unlink()
                dist.barrier()
    # Round 0 starts with the DCP save, so dd always knows the byte count to match.

    # 2. stall. An async save only pays off when the steps until the next save take longer than
    # writing one (otherwise saves queue up whatever the design), so the async side trains for at
    # least one sync save's duration before waiting for its save. Step times during the background
    # write are reported too: on a small CPU-only host the writer competes with training for cores.
    step_s = statistics.median(_timed_steps(trainer, 3))
    save_s = nbytes / statistics.median(dcp_bps)
    cover = max(args.interval, math.ceil(save_s / step_s))
    stall: dict[str, list[float]] = {"async": [], "sync": []}
    during_write: list[float] = []
    for i in range(2 * args.rounds):
        kind = "async" if i % 2 == 0 else "sync"
        for _ in range(args.interval):
            trainer.train_step(current[0])
        current[0] = async_ck if kind == "async" else sync_ck
        waited_before = async_ck.staging_wait_s
        start = time.perf_counter()
        save()
        blocked = time.perf_counter() - start
        if kind == "async":
            during_write += _timed_steps(trainer, cover, async_ck)
            start = time.perf_counter()
            async_ck.wait()
            # the call, the optimizer steps' waits for the copy to host memory, and the final wait
            blocked += time.perf_counter() - start + async_ck.staging_wait_s - waited_before
        stall[kind].append(blocked)
    async_ck.close()

    if rank0:
        dcp_med, dd_med = statistics.median(dcp_bps), statistics.median(dd_bps)
        a_med, s_med = statistics.median(stall["async"]), statistics.median(stall["sync"])
        print(
            f"checkpoint: {launch.world_size} rank(s), {nbytes / 1e6:.0f} MB per checkpoint (model + AdamW), "
            f"dir {root}"
        )
        print(
            f"checkpoint save throughput: dcp {dcp_med / 1e6:.0f} MB/s (runs {[round(b / 1e6) for b in dcp_bps]}) "
            f"vs dd {dd_med / 1e6:.0f} MB/s (runs {[round(b / 1e6) for b in dd_bps]})"
        )
        print(f"RATIO checkpoint_save_vs_dd = {dcp_med / dd_med:.3f} (target >= 0.7)")
        print(
            f"checkpoint stall: async {a_med * 1000:.0f} ms (runs {[round(s * 1000) for s in stall['async']]}) "
            f"vs sync {s_med * 1000:.0f} ms (runs {[round(s * 1000) for s in stall['sync']]})"
        )
        print(
            f"checkpoint async: {cover} step(s) between an async save and its wait (one sync save"
            f" {save_s * 1000:.0f} ms / one step {step_s * 1000:.0f} ms); steps while it wrote:"
            f" {statistics.median(during_write) * 1000:.0f} ms (x{statistics.median(during_write) / step_s:.2f})"
        )
        print(f"RATIO checkpoint_async_stall_vs_sync = {a_med / s_med:.3f} (target <= 0.1)")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
