"""MemoryCheckpointer over a real gloo world of 3 processes, each rank on its own (emulated) node."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from _gloo import COLLECTIVE_TIMEOUT_S, run_ranks

_RANK = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from hpkit.runtime.config import MemoryCheckpointSpec
from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer

root, rank, world = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{root.parent / 'store'}", rank=rank, world_size=world)

def state(fill):
    # Entries every rank holds alike (as AdamW's per-parameter step counters and the trainer's step), which
    # DCP writes once, in one rank's file, and each rank's own entry (as an FSDP shard).
    s = {f"shared{i}": torch.full((1024,), float(fill)) for i in range(9)}
    s[f"own{rank}"] = torch.full((4096,), float(fill + rank))
    return s

spec = MemoryCheckpointSpec(every=1)
saver = MemoryCheckpointer(spec, root, f"n{rank}", log=lambda line: None)
saver.save(5, state(5))
saver.wait()
saver.close(completed=False)

# Rank 0 and rank 2 (which held rank 0's copy) both on new nodes: rank 0's state is lost, and rank 0's line names
# the rank and the node it was saved on (that map comes from the one node left holding the step).
lines = []
lost = MemoryCheckpointer(spec, root, f"spare{rank}" if rank in (0, 2) else f"n{rank}", log=lines.append)
lost_step = lost.restore(state(0), newer_than=None)
lost.close(completed=False)

# Rank 2 comes back on a new node, which holds nothing: what it reads comes from its peers.
restorer = MemoryCheckpointer(spec, root, "spare" if rank == 2 else f"n{rank}", log=lambda line: None)
loaded = state(0)
step = restorer.restore(loaded, newer_than=None)
values = sorted({float(v[0]) for v in loaded.values()})
received = sorted(p.name for p in (root / "spare").glob("step-*/*.distcp")) if rank == 2 else []
restorer.close(completed=False)

print(json.dumps({"rank": rank, "step": step, "values": values, "received": received, "lost_step": lost_step, "lines": lines}))
dist.destroy_process_group()
"""


def test_a_rank_on_a_new_node_receives_its_own_state_and_rank_0s_not_every_ranks(tmp_path, repo):
    """Entries every rank holds alike go to rank 0's file, so a rank on a new node pulls at most its own file and
    rank 0's, not (as DCP's default balancing of those entries over all ranks' files has it) every rank's file:
    the bytes a peer restore moves grow with a rank's state, not with the job's."""
    root = tmp_path / "mem" / "run"
    world = 3
    root.parent.mkdir(parents=True)  # the ranks' rendezvous file goes there
    env = dict(os.environ, PYTHONPATH=str(repo / "python"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(root), str(rank), str(world)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["step"] == 5
        assert r["values"] == sorted({5.0, 5.0 + r["rank"]})  # every entry as saved
    assert results[2]["received"] == ["__0_0.distcp", "__2_0.distcp"]
    assert [r["lost_step"] for r in results] == [None, None, None]
    (line,) = results[0]["lines"]
    assert "in-memory checkpoint step 5 is incomplete: the state of rank(s) 0 was held only on n0" in line, (
        line
    )


# ------------------------------------------------------------------------------------------------------------
# Host memory: MemoryCheckpointSpec.host_copies (what `hpkit plan`'s host-memory column and the start-up line
# multiply by the state's bytes) against what a save's copies take, measured on real gloo ranks.

_STATE_MIB = 24  # per rank: large beside what a save's bookkeeping takes, small for a unit test


def _anon_rss() -> int:
    """The process's own memory (RssAnon): the staging copy lives there. Pages of tmpfs files the exchange maps
    are the node folder's, and are counted there."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _folder_bytes(path) -> int:
    """Bytes the folder's files take in node memory (allocated blocks: a file part-written counts as it is)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _host_memory_of_saves(rank: int, world: int, root: str, out: str) -> None:
    import shutil
    from pathlib import Path

    import torch

    from hpkit.plan.host_memory import host_bytes_per_rank
    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec

    spec = MemoryCheckpointSpec(every=1, replicas=1)
    saver = MemoryCheckpointer(spec, Path(root), f"n{rank}", log=lambda line: None)
    elements = _STATE_MIB * 2**20 // 4
    state = {f"own{rank}": torch.arange(elements, dtype=torch.float32) + rank, "step": torch.tensor(0)}
    # The peak host_copies describes: a step's copies all in place (own file, the partner's) while the previous
    # step's are still kept, plus the staging copy. It is the moment the older step's folder is removed.
    peak: dict[str, int] = {}
    real_rmtree = shutil.rmtree

    def read_peak_then_remove(path, *args, **kwargs):
        if Path(path).parent == saver.node_dir and Path(path).name.startswith("step-"):
            peak["folder"] = _folder_bytes(saver.node_dir)
            peak["process"] = _anon_rss() - before
        return real_rmtree(path, *args, **kwargs)

    before = _anon_rss()  # nothing staged yet: the stager allocates its copy on the first save
    shutil.rmtree = read_peak_then_remove  # this rank's own process (forked): no other test sees it
    try:
        for step in (1, 2):
            state[f"own{rank}"].add_(1.0)
            saver.save(step, state)
            saver.wait()
    finally:
        shutil.rmtree = real_rmtree
    assert saver.last_step == 2, "the second in-memory step did not complete"
    predicted = host_bytes_per_rank(saver.state_bytes, spec)
    saver.close(completed=False)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({**peak, "predicted": predicted, "state": saver.state_bytes}), encoding="utf-8"
    )


def test_host_memory_of_the_copies_is_what_the_planner_predicts(tmp_path):
    """`host_bytes_per_rank` (host_copies x the rank's state bytes, the planner's host-memory column) is the node
    memory a save's copies take at the peak, within 10 %: the node folder in tmpfs (the rank's own file and its
    partner's, for two steps while the newer completes) plus the process's growth (the staging copy). Two
    ranks, each its own node (the other's partner), so each folder holds one rank's file and one partner's."""
    from hpkit.runtime.checkpoints.memory_layout import ROOT_ENV
    from hpkit.runtime.watchdog.hang_board import node_local_base

    # Node memory as the runtime uses it (/dev/shm where there is one), in a folder of this test's own.
    root = node_local_base(None, ROOT_ENV) / f"hpkit-test-host-memory-{os.getpid()}" / "run"
    out = tmp_path / "measured"
    out.mkdir()
    try:
        run_ranks(_host_memory_of_saves, 2, tmp_path, str(root), str(out))
    finally:
        import shutil

        shutil.rmtree(root.parent, ignore_errors=True)
    for rank in range(2):
        m = json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
        assert m["state"] >= _STATE_MIB * 2**20, m  # the rank's file holds its state
        measured = m["folder"] + m["process"]
        assert abs(measured / m["predicted"] - 1) <= 0.10, (
            f"rank {rank}: node folder {m['folder'] / 2**20:.1f} MiB + process growth {m['process'] / 2**20:.1f} MiB"
            f" = {measured / 2**20:.1f} MiB at the peak vs predicted {m['predicted'] / 2**20:.1f} MiB"
        )


def _saved_step_1(rank: int, root: str):
    """A rank's in-memory checkpointer on node n<rank>, with step 1 saved and copied: (saver, state, log lines)."""
    from pathlib import Path

    import torch

    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec

    lines: list[str] = []
    saver = MemoryCheckpointer(MemoryCheckpointSpec(every=1), Path(root), f"n{rank}", log=lines.append)
    state = {f"own{rank}": torch.ones(1024), "step": torch.tensor(0)}
    saver.save(1, state)
    saver.wait()
    return saver, state, lines


def _a_failed_copy(rank: int, world: int, root: str) -> None:
    import torch

    saver, state, lines = _saved_step_1(rank, root)

    working = saver._exchange

    def broken(
        sends, receives, failure=None
    ):  # a timed-out or closed gloo pair: it raises, and the group stays unusable
        torch.distributed.destroy_process_group(saver.group)
        raise RuntimeError("Connection closed by peer")

    saver._exchange = broken
    saver.save(2, state)
    saver.wait()
    assert saver.last_step == 1, saver.last_step
    # The failed step's files are gone from the node; the complete step before it stays, for a restore.
    assert sorted(p.name for p in saver.node_dir.iterdir()) == ["step-00000001"], list(
        saver.node_dir.iterdir()
    )
    if rank == 0:
        assert any("in-memory checkpoint not completed" in line for line in lines), lines
    # The next copy runs on a new group: the tier does not stay at step 1 for the rest of the run.
    saver._exchange = working
    saver.save(3, state)
    saver.wait()
    assert saver.last_step == 3, saver.last_step
    assert sorted(p.name for p in saver.node_dir.iterdir()) == ["step-00000003"]
    if rank == 0:
        assert any("a new group for the copies" in line for line in lines), lines
    saver.close(completed=False)


def test_a_failed_copy_leaves_no_files_of_its_step_in_node_memory_and_the_next_copy_works(tmp_path):
    """A copy that failed keeps the complete step before it and says so; what the failed step had written is
    removed (it is never restored from, and each failed step would otherwise hold one more state in RAM); and
    the copy after it runs on a new group, since the broken one stays broken."""
    run_ranks(_a_failed_copy, 2, tmp_path, str(tmp_path / "mem" / "run"))


def _one_node_without_room(rank: int, world: int, root: str) -> None:
    import errno
    import time

    from hpkit.runtime.checkpoints import memory_checkpoint

    saver, state, lines = _saved_step_1(rank, root)
    mapped = memory_checkpoint._mapped

    def full(path, size=None):  # n1's node memory is full: a new file gets no pages
        if size is not None:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return mapped(path, size)

    if rank == 1:
        memory_checkpoint._mapped = full
    started = time.monotonic()
    saver.save(2, state)
    saver.wait()
    took = time.monotonic() - started
    # Both ranks learn of it at once: n0 did not wait in the transfer or the barrier for the group's timeout.
    assert took < COLLECTIVE_TIMEOUT_S / 3, took
    assert saver.last_step == 1, saver.last_step
    assert sorted(p.name for p in saver.node_dir.iterdir()) == ["step-00000001"]
    assert not list(saver.node_dir.rglob("*.part")), list(saver.node_dir.rglob("*"))
    if rank == 0:
        assert any(
            "in-memory checkpoint not completed" in line
            and "no room for the copies on n1: No space left on device" in line
            for line in lines
        ), lines
    memory_checkpoint._mapped = mapped
    saver.save(3, state)
    saver.wait()
    assert saver.last_step == 3, saver.last_step
    # The group was never broken: the copies go on without a new one.
    assert not any("a new group" in line for line in lines), lines
    saver.close(completed=False)


def test_one_node_without_room_for_its_copies_fails_the_step_on_every_rank_at_once(tmp_path):
    run_ranks(_one_node_without_room, 2, tmp_path, str(tmp_path / "mem" / "run"))


def _restore_without_room_for_the_metadata(rank: int, world: int, root: str) -> None:
    import errno
    import time

    import torch.distributed as dist

    from hpkit.runtime.checkpoints import memory_checkpoint
    from hpkit.runtime.checkpoints.memory_layout import METADATA

    saver, state, lines = _saved_step_1(rank, root)
    dist.barrier()
    if rank == 1:  # n1 lost its copy of the metadata, and its node memory is full: it cannot write it again

        def full(path, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        next(saver.node_dir.glob("step-*")).joinpath(METADATA).unlink()
        memory_checkpoint._write_whole = full
    dist.barrier()
    started = time.monotonic()
    assert saver.restore(state, None) is None
    took = time.monotonic() - started
    assert took < COLLECTIVE_TIMEOUT_S / 3, took  # n0 did not wait for n1 in a barrier until the timeout
    if rank == 0:
        assert any(
            "in-memory step 1 not restored (no room for the copies on n1: No space left on device); "
            "resuming from checkpoint.dir instead" in line
            for line in lines
        ), lines
    saver.close(completed=False)


def test_a_restore_that_cannot_write_the_metadata_on_one_node_falls_back_on_every_rank_at_once(tmp_path):
    run_ranks(_restore_without_room_for_the_metadata, 2, tmp_path, str(tmp_path / "mem" / "run"))


def test_a_received_file_takes_its_node_memory_up_front(tmp_path):
    """A sparse file maps fine on a full tmpfs, and the first write past the free pages kills the rank with SIGBUS;
    reserved when it is made, a full node is an ENOSPC the copies can agree on."""
    from hpkit.runtime.checkpoints.memory_checkpoint import _mapped

    path = tmp_path / "received"
    size = 3 << 20
    buffer = _mapped(path, size)
    assert buffer.numel() == size
    assert path.stat().st_blocks * 512 >= size, path.stat().st_blocks


def _auto_every(rank: int, world: int, root: str, out: str) -> None:
    import time
    from pathlib import Path

    import torch

    from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec

    lines: list[str] = []
    torch.serialization.set_crc32_options(
        True
    )  # torch's default, which a Checkpointer in this process turns off
    saver = MemoryCheckpointer(MemoryCheckpointSpec(), Path(root), f"n{rank}", log=lines.append)
    # Without a persistent Checkpointer too: torch.save's zip CRC32s more than doubled the write (1.53 vs 0.65 s
    # for 1.5 GiB), and torch.load never checks them.
    assert not torch.serialization.get_crc32_options()
    # A state whose write takes far longer than a step, as on a GPU (an H200 steps 125M in 32 ms and writes its
    # 1.5 GiB of state in 1.6 s): one save a step would make every step wait for a write.
    state = {f"own{rank}": torch.ones(8 * 2**20 // 4)}
    exchange = saver._exchange

    def slow(*args, **kwargs):  # the partner copy: far longer than a step
        time.sleep(0.2)
        return exchange(*args, **kwargs)

    saver._exchange = slow
    saved = []
    step = 0
    chosen = None
    # Step 1 is timed without a save, step 2 saves (warming up), the steps after it are timed beside its write until
    # it has ended on both ranks; one more step is timed without a save, the next saves, the steps beside that write
    # are timed until it has ended, and the last of them chooses. Its first interval is timed whole, and the step
    # that ends it looks again; then up to the new interval's first save.
    while saver.reviewed_at is None or step < saver.reviewed_at + saver.every:
        step += 1
        plain = 0.005 * (rank + 1)  # a training step (the ranks' differ: the slower one's must count)
        # Once chosen, a step beside a write takes 3x as long: later saves cost more than the one timed (an
        # H200: 247 and 423 ms timed, ~760 ms a save over whole intervals).
        writing = saver._background is not None and saver._background.is_alive()
        time.sleep(plain * (3 if chosen is not None and writing else 1))
        if saver.save(step, state):
            saved.append(step)
        if chosen is None and saver.every is not None:
            chosen = saver.every
    saver.wait()
    saver.close(completed=True)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "every": saver.every,
                "chosen": chosen,
                "chose_at": saver.chose_at,
                "reviewed_at": saver.reviewed_at,
                "saved": saved,
                "lines": lines,
            }
        ),
        encoding="utf-8",
    )


def test_every_auto_chooses_one_interval_for_every_rank_from_a_warm_save_and_looks_again_after_it(tmp_path):
    """`every: auto` (the default): a step is timed without a save, a first save warms up, then a second save is
    measured with the steps beside its write, and then every rank takes the same interval, one that gives the
    write time to finish beside training; the saves after it fall on its multiples. Without it a state that writes
    slower than a step saved every step, and each step waited for a write.

    Its first whole interval is timed, and where its save cost more than the timed one (here its write slows the
    steps beside it 3x), every rank takes a longer interval at its end. Without that look, the interval chosen
    from one timed save stayed (an H200: 8.6 % over plain steps where 5 % was aimed at)."""
    from hpkit.runtime.checkpoints.memory_checkpoint import AUTO_STEPS_BESIDE

    root = tmp_path / "mem" / "run"
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_auto_every, 2, tmp_path, str(root), str(out))
    ranks = [json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]
    chosen, every = ranks[0]["chosen"], ranks[0]["every"]
    assert chosen is not None and chosen > 1, ranks[0]
    for key in ("chosen", "every", "chose_at", "reviewed_at", "saved"):
        assert ranks[1][key] == ranks[0][key], (key, ranks)
    decided, reviewed = ranks[0]["chose_at"], ranks[0]["reviewed_at"]
    warm, timed = ranks[0]["saved"][:2]
    assert warm == 2 and timed >= warm + AUTO_STEPS_BESIDE + 1, ranks[0]
    assert decided >= timed + AUTO_STEPS_BESIDE, ranks[0]
    first = next(s for s in range(decided, decided + chosen) if s % chosen == 0)
    assert reviewed == first + chosen, ranks[0]
    expected = [s for s in range(decided, reviewed) if s % chosen == 0]
    expected += [s for s in range(reviewed, reviewed + every) if s % every == 0]
    assert ranks[0]["saved"][2:] == expected, ranks[0]
    line = next(line for line in ranks[0]["lines"] if "(every: auto)" in line)
    assert f"in-memory checkpoints every {chosen} step(s) (every: auto): a save costs training" in line, line
    # The steps beside the later write took 3x as long: a longer interval, said in one line.
    assert every > chosen, ranks[0]
    line = next(line for line in ranks[0]["lines"] if "after its first interval" in line)
    assert f"every {every} step(s) (every: auto, was {chosen} after its first interval)" in line, line


@pytest.mark.parametrize(
    ("every", "message"),
    [
        (0, "0 is not a number of steps: save every N steps with N >= 1, or auto"),
        ("often", "'often' is neither a number of steps nor auto"),
        (2.5, "2.5 is neither a number of steps nor auto"),
    ],
)
def test_a_bad_every_is_one_line_naming_the_field(tmp_path, every, message):
    import yaml

    from hpkit.errors import SpecError
    from hpkit.spec import load_run_config

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "checkpoint": {"memory": {"every": every}}}))
    with pytest.raises(SpecError) as refused:
        load_run_config(path)
    assert f"checkpoint.memory.every: {message}" in str(refused.value), str(refused.value)
    assert "Input should be" not in str(refused.value)


def test_the_write_cost_counts_a_slow_first_step_once_and_a_steady_slowdown_over_the_whole_write():
    """What `every: auto` charges a save's write. On a GPU (an H200, 125M: a step 47 ms alone) the step after a save
    carried the staging copy (300 ms), and the steps over the rest of the 1.2 s write ran at 50-55 ms: the one slow
    step is counted once, and the rest of the write at the later steps' rate. Charged at the first step's rate, the
    cost was 3x, and so was the interval. Where ranks train on the cores that
    write (CPU), every step beside it is slow, and the rest of the write is charged at that rate."""
    from hpkit.runtime.checkpoints.memory_checkpoint import write_cost

    gpu = write_cost(0.047, [0.300, 0.055, 0.050], waited_s=1.0)
    rate = (0.008 + 0.003) / (0.055 + 0.050)
    assert gpu == pytest.approx(0.253 + 0.008 + 0.003 + rate * 1.0)
    assert gpu < 0.4, gpu  # the first step's rate over the write (253/300 x 1 s) would add 0.84 s
    cpu = write_cost(0.050, [0.100, 0.100, 0.100], waited_s=1.0)
    assert cpu == pytest.approx(3 * 0.050 + 0.5 * 1.0)
    # Faster steps beside the write (noise) cost nothing, and nothing is charged where the write had ended.
    assert write_cost(0.050, [0.049, 0.048, 0.050], waited_s=0.0) == 0.0
    assert write_cost(0.050, [0.080], waited_s=0.5) == pytest.approx(0.030)


def _auto_beside_a_slow_write(rank: int, world: int, root: str, out: str) -> None:
    import time
    from pathlib import Path

    import torch

    from hpkit.runtime.checkpoints.memory_checkpoint import AUTO_STEPS_BESIDE, MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec

    # The asks go over a group of the caller's (hpkit train's: the trainer's CPU group); counted here.
    asking = torch.distributed.new_group(backend="gloo")
    reduce = torch.distributed.all_reduce
    asks = []

    def counted(tensor, *args, group=None, **kwargs):
        if group is asking:
            asks.append(1)
        return reduce(tensor, *args, group=group, **kwargs)

    torch.distributed.all_reduce = counted
    lines: list[str] = []
    saver = MemoryCheckpointer(
        MemoryCheckpointSpec(), Path(root), f"n{rank}", log=lines.append, asking=asking
    )
    exchange = saver._exchange
    writes = []

    def slow(*args, **kwargs):  # the partner copy of a large state: far longer than a step
        # The first save's twice as long, as a GPU's first write is (pinned buffers allocated, pages faulted in).
        time.sleep(3.0 if not writes else 1.5)
        writes.append(1)
        return exchange(*args, **kwargs)

    saver._exchange = slow
    state = {f"own{rank}": torch.ones(1024)}
    calls = []
    step = 0
    while saver.every is None and step < 1000:
        step += 1
        time.sleep(0.01)
        began = time.perf_counter()
        saver.save(step, state)
        calls.append(time.perf_counter() - began)
    saver.wait()
    saver.close(completed=True)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "every": saver.every,
                "chose_at": saver.chose_at,
                "longest_call": max(calls[2:]),
                "k": AUTO_STEPS_BESIDE,
                "asks": len(asks),
                "lines": lines,
            }
        ),
        encoding="utf-8",
    )


def test_every_auto_trains_on_while_its_writes_run_and_chooses_from_the_warm_one(tmp_path):
    """`every: auto` keeps timing steps until a save's write has ended on every rank, and then chooses: no step
    stalls for the rest of a long write (1.6-13 s on an H200), and the write's cost is measured over the steps it
    ran beside, not extrapolated. Without it every rank waited for the whole write at the third step beside it.
    It chooses from the second save: the first one costs more (an H200: a 125M save charged 915 ms timed on the
    first, 247-423 ms on the second; 1B 5.0 s against 0.7-0.9 s), and timed on it auto chose 636 and 1,062 steps."""
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_auto_beside_a_slow_write, 2, tmp_path, str(tmp_path / "mem" / "run"), str(out))
    ranks = [json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]
    assert ranks[0]["chose_at"] == ranks[1]["chose_at"] and ranks[0]["every"] == ranks[1]["every"], ranks
    # A 1.5 s write beside 10 ms steps: tens of steps, not the 3 it must time at least.
    assert ranks[0]["chose_at"] > 2 + ranks[0]["k"] + 10, ranks
    # No save call waited for the write: one that did would have taken the rest of its 1.5 s, begun three 10 ms
    # steps before (over 1 s of it unless those steps took 160 ms each); a loaded host's slow call stays below.
    assert max(r["longest_call"] for r in ranks) < 1.0, ranks
    # It asked at doubling gaps, about log2 of the steps it timed beside each of the two writes (a world all-reduce
    # a step costs ~1 s at 16k ranks over gloo), over the caller's group.
    timed = ranks[0]["chose_at"] - 2
    assert 2 <= ranks[0]["asks"] <= 2 * (math.ceil(math.log2(timed)) + 1), ranks
    # And the interval leaves the write its time: at least its length in steps (figures as rank 0 printed them).
    line = next(line for line in ranks[0]["lines"] if "(every: auto)" in line)
    write_s, step_ms = re.search(r"writes for ([\d.]+) s; a step takes (\d+) ms", line).groups()
    assert float(write_s) >= 1.5 and ranks[0]["every"] >= float(write_s) * 1000 / (int(step_ms) + 1), line
    # The second write's 1.5 s, not the first one's 3 s.
    assert float(write_s) < 2.5, line


def _auto_after_a_failed_timed_save(rank: int, world: int, root: str) -> None:
    import time
    from pathlib import Path

    import torch

    from hpkit.runtime.checkpoints.memory_checkpoint import AUTO_STEPS_BESIDE, MemoryCheckpointer
    from hpkit.runtime.config import MemoryCheckpointSpec

    saver = MemoryCheckpointer(MemoryCheckpointSpec(), Path(root), f"n{rank}", log=lambda line: None)
    state = {f"own{rank}": torch.ones(1024)}
    working = saver._exchange

    def broken(sends, receives, failure=None):  # a closed gloo pair: it raises, and the group stays unusable
        saver._exchange = working  # once: the next save's copies work
        torch.distributed.destroy_process_group(saver.group)
        raise RuntimeError("Connection closed by peer")

    def next_save(step: int) -> int:
        while not saver.save(step := step + 1, state):
            assert step < 1000, "no save"
            time.sleep(0.005)  # a training step: it asks at doubling gaps in steps, so steps must take time
        return step

    assert not saver.save(1, state)  # a step timed without a save
    assert saver.save(2, state)  # the first save, which warms up
    saver.wait()  # its copies done (they call _exchange on the background thread)
    saver._exchange = broken  # the save after it, the one timed, fails
    timed = next_save(2)
    assert timed >= 2 + AUTO_STEPS_BESIDE + 1, timed
    # Steps timed beside its write until it has ended; then the step that would choose finds its costs unknown
    # (it failed, and broke the copies' group), and saves again.
    step = next_save(timed)
    assert saver.every is None and step >= timed + AUTO_STEPS_BESIDE, (saver.every, step)
    again = step
    while saver.every is None and step < again + 500:  # and from its costs the interval is chosen
        time.sleep(0.005)
        saver.save(step := step + 1, state)
    saver.wait()
    chose_at = saver.chose_at
    assert saver.every is not None and chose_at is not None and chose_at > again, (
        saver.every,
        chose_at,
        again,
    )
    # No save since that one's but at the step that chose, where it falls on the interval (the saves fall on its
    # multiples from there: CI saw every 13 chosen at step 13).
    saved = chose_at if chose_at % saver.every == 0 else again
    assert saver.last_step == saved, (saver.every, chose_at, again, saver.last_step)
    saver.close(completed=True)


def test_every_auto_measures_again_after_a_timed_save_that_failed(tmp_path):
    """A timed save that failed gives no costs to choose by: the next step saves and measures again (on a new
    group for the copies: the failed one may have broken it), and the interval comes from that save."""
    run_ranks(_auto_after_a_failed_timed_save, 2, tmp_path, str(tmp_path / "mem" / "run"))
