"""In-memory checkpoints (`checkpoint.memory`): what saving every step costs, how fast each kind of restore is,
and how much host memory the copies take against `MemoryCheckpointSpec.host_copies`.

Runs the runtime's own Trainer (FSDP2 over all ranks, model + AdamW state, as bench_checkpoint.py), each rank
on its own emulated node (its own node folder under the memory root, so rank 0's partner is rank 1), for two
model sizes whose state differs about 10x. Sides are measured in the same run, alternating, medians of
`--rounds`:
  1. copy cost: step time with `MemoryCheckpointer.save` after every step vs no memory tier, in alternating
     blocks of `--block` steps of the same Trainer (a memory block's time includes waiting for its last
     copy, so no copy spills into the next block); target ratio <= 1.05 at 125M. Where the time goes, per
     saved step: the save call (plan, barrier, start of staging), the optimizer step's wait for the staging
     copy (`staging_wait_s`), waiting for the previous step's write and copy before the next save, and the
     background's partner copy (`copy_s`: metadata, the p2p exchange of the files, the barrier that makes
     the step complete; it overlaps training).
  2. restore, every kind of both sizes in each round in rotating order (the growth between the sizes is
     the target, so both see the same load): (a) from the rank's own node's memory (a restart on the same
     nodes), (b) from a peer (rank 0 comes back as node "spare" with an empty folder: its file comes from
     its partner over gloo), (c) from a persistent checkpoint (the runtime's Checkpointer: a sync save to `--dir` on disk, its
     files dropped from the page cache before each restore, then `restore`, CRC checks included); for (b)
     the bytes moved and the rate, and gloo's loopback rate for the same bytes (a plain send) measured beside
     it. Target: (b)'s time grows between the sizes by no more than the extra bytes at that link rate.
  3. host memory at the peak of a save while the previous step is still kept: the node folder (own file and
     the partner's, both generations; read at the moment the older step is removed) plus the staging copy
     (the stager's cached buffers), against host_copies x state bytes per rank; target within 10 %. The
     process's transient growth during the save (sampled RssAnon: buffers of the copy) is printed apart.

    torchrun --nproc-per-node 2 bench/bench_memory_checkpoint.py [--rounds 3] [--block 2] [--sizes 13M,125M]

The copies go under HPKIT_MEMORY_ROOT (else /dev/shm), in a folder of their own, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from _memory_saves import block_side, saved_step

# name -> model overrides of the "125M" shape: ~13M and ~134M parameters (state = params + AdamW's two moments)
SIZES: dict[str, dict[str, int]] = {
    "13M": {"dim": 256, "n_layers": 6, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 768, "vocab_size": 16000},
    "125M": {},
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpkit-bench-memckpt"))
    p.add_argument("--rounds", type=int, default=3, help="rounds of each side (medians)")
    p.add_argument("--block", type=int, default=2, help="training steps per block in part 1")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {','.join(SIZES)}")
    return p.parse_args()


def main() -> int:
    args = _parse()
    from hpkit.runtime.env import distributed

    with distributed() as job:
        _measure(args, job.launch, job.device)
    return 0


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _folder_bytes(path: Path) -> int:
    """Bytes a folder takes in tmpfs (allocated blocks, so a sparse or partly written file counts as it is)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with suppress(OSError):  # removed while walking
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _rss_bytes() -> int:
    """The process's own memory (RssAnon): pages of tmpfs files it maps are the node folder's, counted there."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _drop_cache(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _staging_bytes(memory: Any, state_tensors: int) -> int:
    """The stager's cached copy of the state (DCP keeps it for the checkpointer's life and refills it each
    save); the state's tensor bytes where the stager's internals are not what this torch has."""
    try:
        cached = memory._stager._state_dict_stager._cached_storage_mapping
        return sum(s.nbytes() for s in cached.values())
    except AttributeError:
        return state_tensors


def _measure(args: argparse.Namespace, launch, device) -> None:
    import torch.distributed as dist

    from hpkit.runtime.checkpoints.memory_layout import memory_root
    from hpkit.runtime.config import MemoryCheckpointSpec

    if launch.world_size != 2:
        raise SystemExit("bench_memory_checkpoint: run with torchrun --nproc-per-node 2 (each rank one node)")
    disk = Path(args.dir)
    key: list[Any] = [f"bench-{os.getpid()}-{int(time.time())}"]
    dist.broadcast_object_list(key, src=0)
    mem_base = memory_root() / str(key[0])  # HPKIT_MEMORY_ROOT, else /dev/shm
    if launch.rank == 0:
        shutil.rmtree(disk, ignore_errors=True)
        disk.mkdir(parents=True)
    dist.barrier()
    spec = MemoryCheckpointSpec(every=1, replicas=1)
    load_start = os.getloadavg()  # the 1-, 5- and 15-minute load: how shared the machine was
    results: dict[str, dict[str, Any]] = {}
    for size in (s.strip() for s in args.sizes.split(",")):
        results[size] = _one_size(args, size, launch, device, spec, disk, mem_base / size)
        dist.barrier()
    # 2. restores: every kind of both sizes in each round, in rotating order, so that the two sizes' peer
    # restores (whose difference the target is about) see the same load.
    sides = [(size, kind) for size in results for kind in ("own", "peer", "persistent", "link")]
    for i in range(args.rounds):
        shift = (i * 3) % len(sides)
        for size, kind in sides[shift:] + sides[:shift]:
            _restore_once(results[size], kind, launch.rank)
    for r in results.values():
        for key in [k for k in r if k.startswith("_")]:
            del r[key]
    if launch.rank == 0:
        _report(args, results, spec.host_copies, load_start, mem_base)
        shutil.rmtree(mem_base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def _one_size(args, size: str, launch, device, spec, disk: Path, root: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hpkit.runtime.checkpoints.checkpoint import Checkpointer, committed
    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
    from hpkit.runtime.config import CheckpointSpec, ModelSpec, ParallelismSpec, RunConfig, TrainSpec
    from hpkit.runtime.loop.trainer import Trainer

    rank = launch.rank
    node = f"node{rank}"  # each rank its own emulated node: rank 0's partner is rank 1 and back

    def quiet(line: str) -> None:
        """The checkpointer's lines would interleave with the figures."""

    cfg = RunConfig(
        name=f"memckpt-bench-{size}",
        output_dir=str(disk / "logs" / size),
        parallelism=ParallelismSpec(dp_shard=-1),
        model=ModelSpec(name="125M", seq_len=64, **SIZES[size]),
        train=TrainSpec(local_batch_size=1, tensorboard=False),
    )
    trainer = Trainer(cfg, device)
    params = trainer.adapter.num_params(trainer.model_cfg)
    trainer.train_step()  # optimizer state exists from here on, as in a real checkpoint
    memory = MemoryCheckpointer(spec, root, node, log=quiet)
    memory.save(trainer.step, trainer.checkpoint_state())  # plans (cached from then on), fills the stager
    memory.wait()

    # 1. copy cost: alternating blocks of steps with and without a save after each.
    block_s: dict[str, list[float]] = {"none": [], "memory": []}
    block_cpu: dict[str, list[float]] = {"none": [], "memory": []}  # CPU seconds per step, both ranks
    parts: dict[str, list[float]] = {"call": [], "staging": [], "previous": [], "copy": []}
    for i in range(2 * args.rounds):
        side = block_side(i)
        dist.barrier()
        cpu_start = time.process_time()
        start = time.perf_counter()
        for _ in range(args.block):
            if side == "none":
                trainer.train_step()
            else:
                saved_step(trainer, memory, parts)
        if side == "memory":
            before = memory.staging_wait_s
            memory.wait()  # the block's last copy, so that none runs into the next block
            parts["staging"][-1] += memory.staging_wait_s - before
        dist.barrier()
        block_s[side].append((time.perf_counter() - start) / args.block)
        used = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
        dist.all_reduce(used)
        block_cpu[side].append(used.item() / args.block)

    # 3. host memory at the peak: a save while the previous step is kept, read as the older step goes.
    state_tensors = sum(
        t.numel() * t.element_size()
        for t in _tensors(trainer.checkpoint_state(), torch)  # what the stager copies
    )
    peak_folder = [0]
    real_rmtree = shutil.rmtree

    node_dir = memory.node_dir

    def rmtree_after_reading(path, *a, **kw):
        if Path(path).parent == node_dir:
            peak_folder[0] = max(peak_folder[0], _folder_bytes(node_dir))
        return real_rmtree(path, *a, **kw)

    rss_before = _rss_bytes()
    sampled = {"rss": 0, "sum": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss = _rss_bytes() - rss_before
            sampled["rss"] = max(sampled["rss"], rss)
            sampled["sum"] = max(sampled["sum"], rss + _folder_bytes(node_dir))
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    last = trainer.train_step(memory)
    rss_before = _rss_bytes()
    shutil.rmtree = rmtree_after_reading
    try:
        sampler.start()
        memory.save(last.step, trainer.checkpoint_state())
        memory.wait()
    finally:
        shutil.rmtree = real_rmtree
        done.set()
        sampler.join()
    staging = _staging_bytes(memory, state_tensors)
    state_bytes = memory.state_bytes
    memory.close(completed=False)  # its copies stay for the restores

    # 2. restores (measured later, alternating with the other size's): a persistent checkpoint to restore.
    persistent = Checkpointer(CheckpointSpec(keep=1), disk / "persist" / size, rank)
    persistent.save(trainer.step, trainer.checkpoint_state(), forced=True)
    persistent.close()
    sent: list[Any] = [state_bytes]
    dist.broadcast_object_list(sent, src=1)  # rank 1's file: what the peer restore sends rank 0
    everyone: list[Any] = [None] * 2
    dist.all_gather_object(everyone, (state_bytes, staging, peak_folder[0], sampled["rss"], sampled["sum"]))
    return {
        "params": params,
        "block": block_s,
        "cpu": block_cpu,
        "parts": parts,
        "restore": {"own": [], "peer": [], "persistent": [], "link": []},
        "moved": [],
        "moved_files": [],
        "ranks": everyone,
        "state_tensors": state_tensors,
        "link_bytes": sent[0],
        # for the restores, not reported
        "_trainer": trainer,
        "_persistent": persistent,
        "_persisted": committed(disk / "persist" / size)[-1][1],
        "_root": root,
        "_spec": spec,
    }


def _restore_once(r: dict[str, Any], kind: str, rank: int) -> None:
    """One restore of `kind` into this size's Trainer (or, for "link", a plain gloo send of rank 1's file's
    bytes), timed from every rank starting to every rank finishing."""
    import torch
    import torch.distributed as dist

    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer

    trainer, root = r["_trainer"], r["_root"]
    node = f"node{rank}"

    def quiet(line: str) -> None:
        """The checkpointer's lines would interleave with the figures."""

    restorer = None
    if kind == "link":
        payload = torch.empty(r["link_bytes"], dtype=torch.uint8)
    elif kind == "persistent":
        _drop_cache(r["_persisted"])  # read from disk, as after a node is lost
    else:
        if rank == 0:
            shutil.rmtree(root / "spare", ignore_errors=True)
        # (b): rank 0 comes back as node "spare", which holds nothing; its file comes from its partner.
        where = "spare" if kind == "peer" and rank == 0 else node
        restorer = MemoryCheckpointer(r["_spec"], root, where, log=quiet)
    dist.barrier()
    start = time.perf_counter()
    if kind == "link":
        if rank == 1:
            dist.send(payload, 0)
        else:
            dist.recv(payload, 1)
    elif kind == "persistent":
        loaded, _ = r["_persistent"].restore(trainer.checkpoint_state())
        assert loaded is not None, "the persistent restore loaded nothing"
    else:
        assert restorer is not None
        step = restorer.restore(trainer.checkpoint_state(), newer_than=None)
        assert step == trainer.step, f"{kind} restore gave step {step}, not {trainer.step}"
    dist.barrier()
    r["restore"][kind].append(time.perf_counter() - start)
    if restorer is not None:
        if kind == "peer" and rank == 0:
            folder = next((root / "spare").glob("step-*"))
            files = sorted(f for f in folder.iterdir() if f.suffix == ".distcp")
            r["moved"].append(sum(f.stat().st_size for f in files))
            r["moved_files"] = [f.name for f in files]
        restorer.close(completed=False)


def _tensors(state: Any, torch) -> list[Any]:
    """The tensors of a checkpoint state (its Stateful parts' state dicts), each storage once."""
    found: dict[int, Any] = {}

    def walk(x: Any) -> None:
        if hasattr(x, "state_dict") and not isinstance(x, torch.Tensor):
            x = x.state_dict()
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            found.setdefault(local.untyped_storage().data_ptr(), local)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(state)
    return list(found.values())


def _report(args, results: dict[str, dict[str, Any]], host_copies: int, load_start, mem_base: Path) -> None:
    mib = 1 << 20
    print(
        f"memory checkpoint: 2 ranks, each its own emulated node, root {mem_base.parent}"
        f" ({_fstype(mem_base.parent)}); {args.rounds} rounds, blocks of {args.block} steps;"
        f" load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
        f" ({os.cpu_count()} CPUs)"
    )
    for size, r in results.items():
        state = [s for s, *_ in r["ranks"]]
        print(
            f"memory checkpoint {size}: {r['params'] / 1e6:.1f}M params, state per rank (its file) "
            f"{' / '.join(f'{b / mib:.1f}' for b in state)} MiB (ranks 0 / 1; tensors {r['state_tensors'] / mib:.1f} MiB)"
        )
        none, mem = r["block"]["none"], r["block"]["memory"]
        p = r["parts"]
        rounds = [round(m / n, 3) for m, n in zip(mem, none, strict=True)]
        print(
            f"memory checkpoint {size} step: no memory tier {_med(none) * 1000:.0f} ms, memory.save every step"
            f" {_med(mem) * 1000:.0f} ms; per saved step (rank 0): save call {_med(p['call']) * 1000:.0f} ms,"
            f" staging wait {_med(p['staging']) * 1000:.0f} ms, wait for the previous write+copy"
            f" {_med(p['previous']) * 1000:.0f} ms, partner copy (background) {_med(p['copy']) * 1000:.0f} ms"
        )
        cpu = r["cpu"]
        print(
            f"memory checkpoint {size} CPU seconds per step (both ranks, their threads included): no memory tier"
            f" {_med(cpu['none']):.2f} s, memory.save every step {_med(cpu['memory']):.2f} s"
            f" (x{_med(cpu['memory']) / _med(cpu['none']):.2f})"
        )
        target = " (target <= 1.05 at 125M)" if size == "125M" else ""
        print(
            f"RATIO memory_checkpoint_step_{size} = {_med(mem) / _med(none):.3f}{target}; per round {rounds}"
        )
        rs = r["restore"]
        moved = _med([float(m) for m in r["moved"]])
        link = r["link_bytes"] / _med(rs["link"])
        print(
            f"memory checkpoint {size} restore: (a) own node {_med(rs['own']):.3f} s, (b) from a peer"
            f" {_med(rs['peer']):.3f} s ({moved / mib:.1f} MiB moved to rank 0: {'+'.join(r['moved_files'])}, {moved / _med(rs['peer']) / mib:.0f} MiB/s),"
            f" (c) persistent (disk, cold) {_med(rs['persistent']):.3f} s; gloo loopback send of"
            f" {r['link_bytes'] / mib:.1f} MiB {_med(rs['link']):.3f} s ({link / mib:.0f} MiB/s)"
        )
        print(
            f"RATIO memory_checkpoint_restore_peer_vs_persistent_{size} = {_med(rs['peer']) / _med(rs['persistent']):.3f}"
            f"; own vs persistent {_med(rs['own']) / _med(rs['persistent']):.3f}"
        )
        predicted = host_copies * state[0]
        _, staging, folder, rss, together = r["ranks"][0]
        print(
            f"memory checkpoint {size} host memory (rank 0's node): folder at its peak {folder / mib:.1f} MiB"
            f" + staging copy {staging / mib:.1f} MiB = {(folder + staging) / mib:.1f} MiB vs predicted"
            f" {host_copies} x {state[0] / mib:.1f} = {predicted / mib:.1f} MiB; transient process growth (RssAnon) during"
            f" the save {rss / mib:.1f} MiB (exchange buffers), folder + that growth at the sampled peak"
            f" {together / mib:.1f} MiB"
        )
        print(
            f"RATIO memory_checkpoint_host_memory_{size} = {(folder + staging) / predicted:.3f} (target 0.9-1.1)"
        )
    if len(results) == 2:
        (small, a), (large, b) = results.items()
        extra = _med([float(m) for m in b["moved"]]) - _med([float(m) for m in a["moved"]])
        link = b["link_bytes"] / _med(b["restore"]["link"])
        grew = _med(b["restore"]["peer"]) - _med(a["restore"]["peer"])
        grew_peer_part = grew - (_med(b["restore"]["own"]) - _med(a["restore"]["own"]))
        allowed = extra / link
        print(
            f"memory checkpoint peer restore {small} -> {large}: grew {grew:.3f} s ({grew_peer_part:.3f} s beyond"
            f" the own-node restore's growth) for {extra / mib:.1f} MiB more, which take {allowed:.3f} s at the"
            f" loopback rate {link / mib:.0f} MiB/s"
        )
        print(
            f"RATIO memory_checkpoint_peer_growth_vs_link = {grew / allowed:.3f} (target <= 1.0);"
            f" beyond own-node growth {grew_peer_part / allowed:.3f}"
        )


def _fstype(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


if __name__ == "__main__":
    sys.exit(main())
