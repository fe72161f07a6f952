"""Distributed checkpoint speed: save throughput vs `dd` of the same bytes, checksum cost, verify speed, async stall.

Runs the runtime's own Trainer and Checkpointer (FSDP2 over all ranks, model + AdamW state). Every
figure compares sides measured in the same run, in rotating order, so that a noisy machine slows
them alike (median of `--rounds`):
  1. save throughput, three sides writing the same bytes to the same disk:
     (a) dd: each rank copies the files it wrote in the last hpkit save (page-cached, so the read
         side is a memory copy) with `dd bs=1M conv=fsync`, one dd per file, the ranks at once;
     (b) hpkit: a sync `Checkpointer.save()` with CRC-32C checksums (the whole call: plan, write,
         fsync per file, commit record, rename, `latest`), each file streamed to disk through a
         16 MiB window of page cache (WRITEBACK_BYTES);
     (b') (b) without the window: each file sits whole in the page cache until its fsync;
     (c) the same save with DCP's plain FileSystemWriter (no checksums, no window, empty commit
         record).
     Target: (b)/(a) >= 0.8; (b')/(c) is what the checksums cost, (b)/(b') what the window gains.
     Each side's CPU seconds (all ranks, dd included) are printed too: on a shared machine they
     vary far less than wall time.
  2. `hpkit ckpt verify` of the last hpkit checkpoint (rank 0): cold (its pages dropped with
     POSIX_FADV_DONTNEED first, so the files come from disk) and warm (page cache), in GB/s.
  3. training with saves, alternating an async and a sync Checkpointer: the time the loop is blocked
     per save (for async: the call, the next optimizer steps' waits for the copy to host memory, and
     waiting for the write to finish before the next save), target async / sync <= 0.1.

    torchrun --nproc-per-node 2 bench/bench_checkpoint.py [--dir /tmp/hpkit-bench/ckpt]
    python3 bench/bench_checkpoint.py            # one process (gloo world of 1)
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

SIDES = ("hpkit", "whole_file", "plain", "dd")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpkit-bench-ckpt"))
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--writer-threads", type=int, default=1, help="checkpoint.writer_threads for both DCP sides"
    )
    p.add_argument("--interval", type=int, default=2, help="training steps between saves (stall part)")
    p.add_argument("--no-stall", action="store_true", help="skip part 3 (async vs sync stall)")
    return p.parse_args()


def _timed_steps(trainer, n: int, checkpointer=None) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        trainer.train_step(checkpointer)
        times.append(time.perf_counter() - start)
    return times


def _dd(sources: list[Path], target: Path) -> None:
    for src in sources:
        subprocess.run(
            ["dd", f"if={src}", f"of={target / src.name}", "bs=1M", "conv=fsync"],
            check=True, capture_output=True,
        )  # fmt: skip


def _warm(sources: list[Path]) -> None:
    """Read files into the page cache (hpkit's save drops its pages behind it), so dd reads memory."""
    for src in sources:
        with src.open("rb", buffering=0) as f:
            while f.read(1 << 20):
                pass


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its finished children (the dd's)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _drop_cache(path: Path) -> None:
    """Evict a file's (clean, already fsynced) pages, so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _verify_s(directory: Path, cold: bool) -> float:
    if cold:
        for f in directory.iterdir():
            _drop_cache(f)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "ckpt", "verify", str(directory)], capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"bench_checkpoint: hpkit ckpt verify {directory} failed: {proc.stdout}{proc.stderr}"
        )
    return seconds


def main() -> int:
    args = _parse()
    from hpkit.runtime.env import distributed

    with distributed() as job:
        _measure(args, job.launch, job.device)
    return 0


def _gbps(nbytes: int, seconds: list[float]) -> str:
    return f"{nbytes / statistics.median(seconds) / 1e9:.3f} GB/s (runs {[round(nbytes / s / 1e9, 3) for s in seconds]})"


def _measure(args: argparse.Namespace, launch, device) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hpkit.runtime.checkpoints.checkpoint import Checkpointer, ChecksummingFileSystem, committed
    from hpkit.runtime.checkpoints.checkpoint_record import read_record
    from hpkit.runtime.config import CheckpointSpec, ModelSpec, ParallelismSpec, RunConfig, TrainSpec
    from hpkit.runtime.loop.trainer import Trainer

    class PlainCheckpointer(Checkpointer):
        """The same save path with DCP's own FileSystemWriter: no checksums, no early writeback (c)."""

        def _writer(self, path: Path):
            self._digests = None
            return dcp.FileSystemWriter(path, thread_count=self.writer_threads)

    class WholeFileCheckpointer(Checkpointer):
        """hpkit's save without the writeback window: whole files in the page cache until fsync (b')."""

        def _writer(self, path: Path):
            writer = super()._writer(path)
            writer.fs = ChecksummingFileSystem(self._digests, writeback_bytes=0)
            return writer

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
    spec = CheckpointSpec(keep=1, writer_threads=args.writer_threads)
    sync_ck = Checkpointer(spec, root / "sync", launch.rank)
    plain_ck = PlainCheckpointer(spec, root / "plain", launch.rank)
    whole_ck = WholeFileCheckpointer(spec, root / "whole_file", launch.rank)
    checkpointers = {"hpkit": sync_ck, "whole_file": whole_ck, "plain": plain_ck}
    async_ck = Checkpointer(CheckpointSpec(keep=1, async_save=True), root / "async", launch.rank)
    trainer = Trainer(cfg, device)
    current = [sync_ck]

    def save() -> None:
        current[0].save(trainer.step, trainer.checkpoint_state(), forced=True)

    trainer.train_step()  # optimizer state exists from here on, as in a real checkpoint
    # A first save of each kind outside the timing: DCP plans it (cached from then on), and dd
    # needs its files to copy.
    for ck in checkpointers.values():
        current[0] = ck
        save()
        ck.close()
    dd_dir = root / "dd"
    if rank0:
        dd_dir.mkdir()

    load_start = os.getloadavg()  # the 1-, 5- and 15-minute load: how shared the machine was
    # 1. throughput: the four sides in rotating order, each round.
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}  # CPU seconds, all ranks and their dd's
    for i in range(args.rounds):
        order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
        for side in order:
            if side != "dd":
                # Each save a new step, as in training: a new directory, the previous one pruned (in
                # the background, joined below). The state is the same bytes either way.
                trainer.step += 1
            else:
                # This rank's files of the newest hpkit checkpoint (its DigestLog: shards, and .metadata on rank 0).
                newest = committed(root / "sync")[-1][1]
                mine = [newest / name for name in sorted(sync_ck._digests.files)]
                for old in dd_dir.iterdir() if rank0 else ():
                    old.unlink()
                _warm(mine)
            dist.barrier()
            cpu_start = _cpu_s()
            start = time.perf_counter()
            if side == "dd":
                _dd(mine, dd_dir)
            else:
                current[0] = checkpointers[side]
                save()
            dist.barrier()
            seconds[side].append(time.perf_counter() - start)
            used = torch.tensor([_cpu_s() - cpu_start], dtype=torch.float64)
            dist.all_reduce(used)
            cpu[side].append(used.item())
            if side != "dd":
                current[0].close()  # joins the thread deleting the pruned checkpoint, outside the timing
    newest = committed(root / "sync")[-1][1]
    nbytes = read_record(newest).total_bytes
    nfiles = len(read_record(newest).files)

    # 2. hpkit ckpt verify on the newest hpkit checkpoint, cold and warm, alternating.
    verify: dict[str, list[float]] = {"cold": [], "warm": []}
    if rank0:
        for i in range(max(2, args.rounds // 2 + 1)):
            for kind in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                verify[kind].append(_verify_s(newest, cold=kind == "cold"))
    dist.barrier()

    # 3. stall. An async save only pays off when the steps until the next save take longer than
    # writing one (otherwise saves queue up whatever the design), so the async side trains for at
    # least one sync save's duration before waiting for its save. Step times during the background
    # write are reported too: on a small CPU-only host the writer competes with training for cores.
    stall: dict[str, list[float]] = {"async": [], "sync": []}
    during_write: list[float] = []
    step_s = save_s = 0.0
    cover = 0
    if not args.no_stall:
        step_s = statistics.median(_timed_steps(trainer, 3))
        save_s = statistics.median(seconds["hpkit"])
        cover = max(args.interval, math.ceil(save_s / step_s))
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
    for ck in (async_ck, *checkpointers.values()):
        ck.close()

    if rank0:
        med = {side: statistics.median(seconds[side]) for side in SIDES}
        print(
            f"checkpoint: {launch.world_size} rank(s), {nbytes} bytes in {nfiles} files per checkpoint"
            f" (model + AdamW), writer_threads {args.writer_threads}, dir {root};"
            f" load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
        )
        for side, what in (
            ("dd", "(a) dd bs=1M conv=fsync, same files"),
            ("hpkit", "(b) hpkit save, CRC-32C on"),
            ("whole_file", "(b') (b) without the writeback window"),
            ("plain", "(c) same save, plain DCP writer"),
        ):
            print(
                f"checkpoint save {what}: {med[side]:.3f} s, {_gbps(nbytes, seconds[side])},"
                f" CPU {statistics.median(cpu[side]):.2f} s"
            )

        def ratio(name: str, fast: str, slow: str, note: str) -> None:
            # medians of each side, and (as a check on drift in the load) each round's own ratio
            rounds = [round(f / s, 3) for f, s in zip(seconds[fast], seconds[slow], strict=True)]
            best = min(seconds[fast]) / min(seconds[slow])  # each side's fastest round: the least disturbed
            print(
                f"RATIO {name} = {med[fast] / med[slow]:.3f} {note}; per round {rounds}; best rounds {best:.3f}"
            )

        ratio("checkpoint_save_vs_dd", "dd", "hpkit", "(b)/(a) throughput, target >= 0.8")
        ratio("checkpoint_save_checksums_vs_plain", "plain", "whole_file", "(b')/(c), 1.0: checksums free")
        ratio("checkpoint_save_writeback_gain", "whole_file", "hpkit", "(b)/(b'), > 1: the window helps")
        print(f"checkpoint verify (hpkit ckpt verify, whole CLI): cold {_gbps(nbytes, verify['cold'])}")
        print(f"checkpoint verify (hpkit ckpt verify, whole CLI): warm {_gbps(nbytes, verify['warm'])}")
        if not args.no_stall:
            a_med, s_med = statistics.median(stall["async"]), statistics.median(stall["sync"])
            print(
                f"checkpoint stall: async {a_med * 1000:.0f} ms (runs {[round(s * 1000) for s in stall['async']]})"
                f" vs sync {s_med * 1000:.0f} ms (runs {[round(s * 1000) for s in stall['sync']]})"
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
