"""What a background write of staged state to node memory takes from the GPU steps beside it, and where.

The in-memory tier stages a rank's state into pinned host memory, then a thread writes it to node memory (tmpfs)
with DCP (torch.save per tensor) while training goes on. Two modes:

    python3 bench/gpu_write_beside.py [--gib 1.5] [--tensors 200]     each way of writing, beside launch-bound steps
    python3 bench/gpu_write_beside.py --trainer 125M                  hpkit's Trainer and MemoryCheckpointer
    python3 bench/gpu_write_beside.py --trainer 125M --split          which part of a save slows the step after it

Ways: torch.save of the pinned buffers, torch.save of pageable copies, DCP's FileSystemWriter (thread_count=1, as
the tier), raw os.write of the bytes, and a sleep (no write: the step alone); then reads back: torch.load + copy to
the GPU, torch.load(mmap=True) + copy, DCP's load into the GPU state. --trainer prints each step's time beside
two saves' writes and samples the training thread's frames meanwhile.

What it found on an H200 (torch 2.11, BENCHMARKS.md): no way of writing slows the steps beside it by more than
x1.17; under the Trainer the one step after a save is slow (+250-310 ms: its staging copy), those after it 0-20 %.
That is what `every: auto` charges a save since (memory_checkpoint.write_cost). `--cpu-dry-run` checks the script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument(
        "--trainer", metavar="MODEL", help="instead: hpkit's Trainer and MemoryCheckpointer (every: 1)"
    )
    p.add_argument(
        "--split", action="store_true", help="with --trainer: the first step beside each part of a save"
    )
    p.add_argument("--cpu-dry-run", action="store_true")
    args = p.parse_args()
    if args.trainer and args.split:
        split_side(args)
        return
    if args.trainer:
        trainer_side(args)
        return
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("skipped: no CUDA device")
        return
    dev = torch.device("cuda" if not args.cpu_dry_run else "cpu")
    if args.cpu_dry_run:
        args.gib, args.tensors = 0.05, 20
    n = int(args.gib * 2**30 / 4 / args.tensors)
    state = {f"t{i:04d}": torch.randn(n, device=dev) for i in range(args.tensors)}
    pinned = {k: torch.empty(n, pin_memory=dev.type == "cuda") for k in state}
    for k, v in state.items():
        pinned[k].copy_(v, non_blocking=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    pageable = {k: v.clone() for k, v in pinned.items()}
    root = Path(os.environ.get("HPKIT_MEMORY_ROOT", "/dev/shm")) / f"hpkit-beside-{os.getpid()}"
    root.mkdir(parents=True)
    # A launch-bound step: many small kernels, as a transformer step of a small model issues.
    x = torch.randn(256, 256, device=dev)
    w = torch.randn(256, 256, device=dev)

    def step() -> float:
        t = time.perf_counter()
        y = x
        for _ in range(300):
            y = torch.tanh(y @ w) * 0.5
        float(y.sum())  # synchronizes
        return time.perf_counter() - t

    def ways():
        yield "sleep (no write)", lambda: time.sleep(1.0)
        yield "torch.save pinned", lambda: torch.save(pinned, root / "a.pt")
        yield "torch.save pageable", lambda: torch.save(pageable, root / "b.pt")
        yield (
            "dcp FileSystemWriter x1 pinned",
            lambda: dcp.save(
                pinned,
                storage_writer=dcp.FileSystemWriter(root / "dcp", thread_count=1, sync_files=False),
                no_dist=True,
            ),
        )

        def raw() -> None:
            with open(root / "raw.bin", "wb", buffering=0) as f:
                for v in pinned.values():
                    f.write(memoryview(v.numpy()).cast("B"))

        yield "os.write pinned", raw

    for _ in range(5):
        step()
    plain = statistics.median(step() for _ in range(20))
    gb = args.gib * 2**30 / 1e9
    print(
        f"gpu_write_beside: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"{args.gib} GiB in {args.tensors} tensors; a step alone {plain * 1000:.1f} ms"
    )
    for name, write in ways():
        times: list[float] = []
        done = threading.Event()
        took = [0.0]

        def run(write=write, took=took, done=done) -> None:
            t = time.perf_counter()
            write()
            took[0] = time.perf_counter() - t
            done.set()

        th = threading.Thread(target=run)
        th.start()
        while not done.is_set():
            times.append(step())
        th.join()
        med = statistics.median(times) if times else float("nan")
        print(
            f"  {name:32s} write {took[0]:6.2f} s ({gb / max(took[0], 1e-9):5.2f} GB/s); "
            f"{len(times):4d} steps beside, median {med * 1000:7.1f} ms = x{med / plain:.2f}, max {max(times) * 1000:.0f} ms"
        )

    # Reads back into the device state.
    def timed(name: str, read) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        read()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - t
        print(f"  read {name:32s} {took:6.2f} s ({gb / took:5.2f} GB/s)")

    def load_copy(mmap: bool) -> None:
        loaded = torch.load(root / "a.pt", mmap=mmap, weights_only=True)
        for k, v in state.items():
            v.copy_(loaded[k], non_blocking=False)

    timed("torch.load + copy", lambda: load_copy(False))
    timed("torch.load mmap + copy", lambda: load_copy(True))
    timed(
        "dcp.load into the device state",
        lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(root / "dcp"), no_dist=True),
    )
    timed(
        "dcp.load into pinned, then copy",
        lambda: (
            dcp.load(pinned, storage_reader=dcp.FileSystemReader(root / "dcp"), no_dist=True),
            [v.copy_(pinned[k], non_blocking=True) for k, v in state.items()],
        ),
    )
    shutil.rmtree(root, ignore_errors=True)


def _trainer(args: argparse.Namespace, name: str, root: Path, device: torch.device):
    """hpkit's Trainer at --trainer's shape (batch 4 for 125M, else 2; sequences of 2048, bf16), or the debug model's
    tiny shape on the CPU (--cpu-dry-run); and the step's synchronisation (a no-op on the CPU)."""
    from hpkit.runtime.config import ModelSpec, ParallelismSpec, RunConfig, TrainSpec
    from hpkit.runtime.loop.trainer import Trainer

    cpu = args.cpu_dry_run
    model, batch, seq = ("debug", 1, 64) if cpu else (args.trainer, 4 if args.trainer == "125M" else 2, 2048)
    cfg = RunConfig(
        name=name,
        output_dir=str(root / "out"),
        parallelism=ParallelismSpec(dp_shard=1),
        model=ModelSpec(name=model, seq_len=seq),
        train=TrainSpec(local_batch_size=batch, tensorboard=False, mixed_precision="fp32" if cpu else "bf16"),
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return Trainer(cfg, device), sync


def trainer_side(args: argparse.Namespace) -> None:
    """The runtime's own path: where the main thread spends a step trained beside a save's write, sampled."""
    import collections
    import sys
    import traceback

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec
    from hpkit.runtime.env import distributed

    root = Path(os.environ.get("HPKIT_MEMORY_ROOT", "/dev/shm")) / f"hpkit-beside-{os.getpid()}"
    with distributed() as job:
        trainer, sync = _trainer(args, "beside", root, job.device)
        model = trainer.cfg.model.name
        said: list[str] = []
        memory = MemoryCheckpointer(MemoryCheckpointSpec(every=1), root / "mem", "node0", log=said.append)
        main_id = threading.get_ident()
        samples: collections.Counter = collections.Counter()
        inner: collections.Counter = collections.Counter()
        sampling = threading.Event()
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                if sampling.is_set():
                    frame = sys._current_frames().get(main_id)
                    if frame is not None:
                        stack = traceback.extract_stack(frame)[-6:]
                        inner[f"{Path(stack[-1].filename).name}:{stack[-1].lineno} {stack[-1].name}"] += 1
                        for f in stack:
                            samples[f"{Path(f.filename).name}:{f.lineno} {f.name}"] += 1
                time.sleep(0.002)

        threading.Thread(target=sampler, daemon=True).start()

        def timed_step(save: bool) -> tuple[float, float]:
            t = time.perf_counter()
            last = trainer.train_step(memory)
            sync()
            took = time.perf_counter() - t
            t = time.perf_counter()
            if save:
                memory.save(last.step, trainer.checkpoint_state())
            return took, time.perf_counter() - t

        for _ in range(2):
            timed_step(True)
            memory.wait()
        plain = statistics.median(timed_step(False)[0] for _ in range(5))
        print(f"trainer {model}: a step alone {plain * 1000:.1f} ms")
        for rnd in range(2):
            _, call = timed_step(True)
            sampling.set()
            beside = []
            while memory._background is not None and memory._background.is_alive():
                beside.append(timed_step(False)[0])
            sampling.clear()
            t = time.perf_counter()
            memory.wait()
            print(
                f"  round {rnd}: save call {call * 1000:.0f} ms; {len(beside)} steps beside its write: "
                + ", ".join(f"{b * 1000:.0f}" for b in beside[:12])
                + f" ms; wait after {time.perf_counter() - t:.2f} s"
            )
        stop.set()
        print("  main thread beside the write, innermost frames:")
        for where, n in inner.most_common(8):
            print(f"    {n:5d}  {where}")
        print("  any frame:")
        for where, n in samples.most_common(14):
            print(f"    {n:5d}  {where}")
        print("  said: " + " | ".join(said[-3:]))
        memory.close(completed=False)
        trainer.close()
    shutil.rmtree(root, ignore_errors=True)


def split_side(args: argparse.Namespace) -> None:
    """Which part of a save slows the one step after it (an H200: +250-310 ms): the step timed beside nothing, beside
    the state's state_dict() alone, beside the staging copy alone (hpkit's stager), and beside a whole async save
    (staging, DCP's planning and the write), each the median of 3."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    from hpkit.runtime.checkpoints.checkpoint import make_stager, skip_zip_crc32
    from hpkit.runtime.env import distributed

    root = Path(os.environ.get("HPKIT_MEMORY_ROOT", "/dev/shm")) / f"hpkit-split-{os.getpid()}"
    with distributed() as job:
        trainer, sync = _trainer(args, "split", root, job.device)
        model = trainer.cfg.model.name
        skip_zip_crc32()
        stager = make_stager()
        # DCP's async save needs a CPU group (the tier's is gloo): the default group is NCCL's on a GPU.
        group = dist.new_group(backend="gloo")

        def step() -> float:
            began = time.perf_counter()
            trainer.train_step()
            sync()
            return time.perf_counter() - began

        def on_thread(work):
            thread = threading.Thread(target=work)
            thread.start()
            return thread.join

        def whole_save():
            saved = dcp.async_save(
                trainer.checkpoint_state(),
                storage_writer=dcp.FileSystemWriter(root / "step", thread_count=1, sync_files=False),
                async_stager=stager,
                process_group=group,
            )
            return lambda: (saved.staging_completion.result(), saved.upload_completion.result())

        parts = {
            "nothing": lambda: lambda: None,
            "state_dict() alone": lambda: on_thread(
                lambda: _stateful_to_state_dict(trainer.checkpoint_state())
            ),
            "the staging copy alone": lambda: on_thread(lambda: stager.stage(trainer.checkpoint_state())),
            "a whole async save": whole_save,
        }
        for _ in range(3):
            step()
        print(
            f"gpu_write_beside --split: {model}, a step alone {statistics.median(step() for _ in range(5)) * 1000:.1f} ms"
        )
        for name, start in parts.items():
            times = []
            for _ in range(3):
                finish = start()
                times.append(step())
                finish()
            print(f"  the first step beside {name}: {statistics.median(times) * 1000:.1f} ms")
        stager.close()
        trainer.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    tempfile.tempdir = None
    main()
