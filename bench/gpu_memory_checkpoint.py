"""In-memory checkpoints on one GPU: what saving a CUDA run's state to node memory costs a step, the interval that
`every: auto` chooses and what a step costs under it, and how fast a restart on the same node restores the state.

The runtime's own Trainer on one GPU (bf16 autocast, fp32 master weights, AdamW) and `MemoryCheckpointer`
(`every: 1`), in a world of one: one node, so no partner copy. What this measures is the part of a save that a GPU
adds and that the CPU bench (bench_memory_checkpoint.py, 2 ranks over gloo) cannot: the staging copy from the GPU
into pinned host memory, which the next optimizer step waits for, and the write of the staged state to node memory
(tmpfs) off the training thread, which the next save waits for. The partner copy over the network comes on top on a
real cluster (measured by the CPU bench).

Sides are measured in the same run: alternating blocks of `--block` steps with a save after every step and
without the memory tier (none, memory, memory, none, ...; a memory block ends waiting for its last write, so none
spills into the next block); medians over `--rounds`. Then restores from the node's memory into the live CUDA
state, timed with the rate in GB/s.

    python3 bench/gpu_memory_checkpoint.py [--model 125M] [--batch 4] [--seq-len 2048] [--block 4] [--rounds 3]

Without a CUDA device it prints "skipped: no CUDA device" and exits 0; `--cpu-dry-run` runs the same code on the
CPU with a tiny shape, only to check the script. The copies go under HPKIT_MEMORY_ROOT (else /dev/shm), in a folder
of their own, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from _memory_saves import block_side, saved_step
from hpkit.runtime.config import AUTO_EVERY_BUDGET


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="125M")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--block", type=int, default=4, help="steps per block")
    p.add_argument("--rounds", type=int, default=3, help="blocks of each side (medians)")
    p.add_argument("--restores", type=int, default=3)
    p.add_argument("--auto-max-steps", type=int, default=500, help="steps timed under every: auto, at most")
    p.add_argument("--cpu-dry-run", action="store_true", help="no GPU: a tiny shape on the CPU")
    return p.parse_args()


def main() -> int:
    args = _parse()
    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("skipped: no CUDA device")
        return 0
    if args.cpu_dry_run:
        args.model, args.batch, args.seq_len, args.block, args.rounds, args.restores = "debug", 1, 64, 2, 1, 1
        args.auto_max_steps = 20
    from hpkit.runtime.env import distributed

    with distributed() as job:
        _measure(args, job.device)
    return 0


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(args: argparse.Namespace, device: Any) -> None:
    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
    from hpkit.runtime.checkpoints.memory_layout import memory_root
    from hpkit.runtime.config import MemoryCheckpointSpec, ModelSpec, ParallelismSpec, RunConfig, TrainSpec
    from hpkit.runtime.loop.trainer import Trainer

    root = memory_root() / f"gpu-bench-{os.getpid()}"
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpkit-gpu-memckpt-{os.getpid()}"
    cfg = RunConfig(
        name="gpu-memckpt",
        output_dir=str(work),
        parallelism=ParallelismSpec(dp_shard=1),
        model=ModelSpec(name=args.model, seq_len=args.seq_len),
        train=TrainSpec(
            local_batch_size=args.batch,
            tensorboard=False,
            mixed_precision="bf16" if device.type == "cuda" else "fp32",
        ),
    )
    trainer = Trainer(cfg, device)
    params = trainer.adapter.num_params(trainer.model_cfg)
    spec = MemoryCheckpointSpec(every=1)
    said: list[str] = []  # a failed copy is a warning line in training; here it voids the figures
    memory = MemoryCheckpointer(spec, root, "node0", log=said.append)
    try:
        # Allocation, cuBLAS's choices, DCP's plan (cached from then on), the stager's buffers.
        for _ in range(2):
            last = trainer.train_step(memory)
            memory.save(last.step, trainer.checkpoint_state())
            memory.wait()
        block_s: dict[str, list[float]] = {"none": [], "memory": []}
        parts: dict[str, list[float]] = {"call": [], "staging": [], "previous": []}
        for i in range(2 * args.rounds):
            side = block_side(i)
            _sync()
            start = time.perf_counter()
            for _ in range(args.block):
                if side == "none":
                    trainer.train_step()
                else:
                    saved_step(trainer, memory, parts)
            if side == "memory":
                memory.wait()
            _sync()
            block_s[side].append((time.perf_counter() - start) / args.block)
        state_bytes = memory.state_bytes
        memory.close(completed=False)  # the newest step stays for the restores
        auto = _auto_side(args, trainer, root.parent / f"{root.name}-auto", said)
        failed = [line for line in said if "not completed" in line]
        if failed:
            raise SystemExit("gpu_memory_checkpoint: a save failed, no figures:\n" + "\n".join(failed[:3]))

        restore_s: list[float] = []
        for _ in range(args.restores):
            again = MemoryCheckpointer(spec, root, "node0", log=lambda line: None)
            _sync()
            t0 = time.perf_counter()
            step = again.restore(trainer.checkpoint_state(), newer_than=None)
            _sync()
            restore_s.append(time.perf_counter() - t0)
            again.close(completed=False)
            assert step is not None, "nothing restored from node memory"
        _report(args, device, params, state_bytes, block_s, parts, restore_s, auto)
        for line in [line for line in said if "(every: auto" in line] or ["every: auto logged no interval"]:
            print("  " + line)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root.parent / f"{root.name}-auto", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        trainer.close()


def _auto_side(args: argparse.Namespace, trainer: Any, root: Path, said: list[str]) -> tuple[int, int, float]:
    """`every: auto` (the default) on the same Trainer: its timed steps, two saves, the step that chooses the
    interval and its first interval, after which it looks again; then whole intervals' steps from a save (two, or one where two are over --auto-max-steps) with a save
    call after each, as `hpkit train` makes them. (interval, steps timed, seconds a step over them, saves and their
    waits included.) The window ends before the next save: its writes end beside training, as in a run, where
    waiting for the last one at the window's end charged a write the next interval would have hidden."""
    from hpkit.runtime.checkpoints.memory_checkpoint import AUTO_MAX_STEPS_BESIDE, MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec

    # Its asks go over the trainer's CPU group, as in hpkit train (the default group is NCCL's on a GPU).
    auto = MemoryCheckpointer(
        MemoryCheckpointSpec(), root, "node0", log=said.append, asking=trainer.cpu_group
    )
    try:
        # A step timed without a save, the first save, the steps timed beside its write; again, then the last of
        # them chooses; at the end of its first interval it looks again.
        for _ in range(2 * AUTO_MAX_STEPS_BESIDE + 10_000):
            last = trainer.train_step(auto)
            auto.save(last.step, trainer.checkpoint_state())
            if auto.reviewed_at is not None:
                break
        else:
            raise SystemExit("gpu_memory_checkpoint: every: auto chose no interval")
        every = auto.every
        while (last.step + 1) % every:  # up to the step before a save: the window starts with one
            last = trainer.train_step(auto)
            auto.save(last.step, trainer.checkpoint_state())
        steps = every * (2 if 2 * every <= args.auto_max_steps else 1)
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            last = trainer.train_step(auto)
            auto.save(last.step, trainer.checkpoint_state())
        _sync()
        took = (time.perf_counter() - start) / steps
        auto.wait()
        return every, steps, took
    finally:
        auto.close(completed=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _report(args, device, params: int, state_bytes: int, block_s, parts, restore_s, auto) -> None:
    import torch

    name = torch.cuda.get_device_name(device.torch_device()) if device.type == "cuda" else "cpu"
    plain, saved = _med(block_s["none"]), _med(block_s["memory"])
    extra = saved - plain
    # The call and the optimizer's wait for the staging copy block the step; the write to node memory runs beside
    # training (one step and a call), and only the next save waits for the rest of it. Which interval that asks
    # for is `every: auto`'s to say (MemoryCheckpointer._choose_every), below.
    blocking = _med(parts["call"]) + _med(parts["staging"])
    background = _med(parts["previous"]) + plain + _med(parts["call"])
    gib = state_bytes / 2**30
    print(
        f"gpu_memory_checkpoint: {name}: model {args.model} ({params / 1e6:.0f}M params), batch {args.batch} x seq "
        f"{args.seq_len}; state {gib:.2f} GiB per rank; load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  step without / with a save every step: {plain * 1000:.1f} / {saved * 1000:.1f} ms = "
        f"{saved / plain:.3f} (target <= {1 + AUTO_EVERY_BUDGET:.2f}; blocks: {', '.join(f'{s * 1000:.0f}' for s in block_s['none'])} "
        f"/ {', '.join(f'{s * 1000:.0f}' for s in block_s['memory'])} ms)"
    )
    print(
        f"  per saved step (median): save call {_med(parts['call']) * 1000:.1f} ms, optimizer's wait for the staging "
        f"copy {_med(parts['staging']) * 1000:.1f} ms, wait for the previous write {_med(parts['previous']) * 1000:.1f} ms"
    )
    print(
        f"  extra per save {extra * 1000:.1f} ms ({extra / max(state_bytes, 1) * 2**30 * 1000:.0f} ms per GiB of state): "
        f"{blocking * 1000:.1f} ms blocking, a write of about {background * 1000:.0f} ms beside training"
    )
    every, steps, auto_s = auto
    print(
        f"  every: auto chose {every}: {auto_s * 1000:.1f} ms a step over {steps} steps, saves included = "
        f"{auto_s / plain:.3f} of a step without (target <= {1 + AUTO_EVERY_BUDGET:.2f})"
    )
    r = _med(restore_s)
    print(
        f"  restore from node memory into the live state: {r:.3f} s (median of {len(restore_s)}), "
        f"{state_bytes / r / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    sys.exit(main())
