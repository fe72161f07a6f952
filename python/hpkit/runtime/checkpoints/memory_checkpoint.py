"""In-memory checkpoints (`checkpoint.memory`): every `every` steps each rank's state goes to its node's RAM
(tmpfs, `memory_layout`), and a copy to a partner node, so that a restart after a lost node or rank restores
from memory, its own node's or a peer's over the job's network, and reads nothing from `checkpoint.dir`.

A save is DCP's async save into the node's folder (the same staging as `checkpoint.async_save`: training waits
only for the copy of the state before the next optimizer step changes it), then, off the training thread,
each rank sends its file to the rank that holds its copy and receives the ones it holds, and every node marks
the step complete once every rank's copy is in place. The newest complete step is kept until the next one is.

A restore runs before the persistent checkpoint's: the ranks gather what their nodes hold, agree on the newest
step that is whole, send each rank the files its load reads that its node lacks, and load with DCP as a
persistent resume does. Where no step is whole (a rank's node and its partner both lost) it says which ranks
and nodes, and the run resumes from `checkpoint.dir` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hpkit.runtime.checkpoints.checkpoint import (
    files_to_read,
    load_into,
    make_stager,
    skip_zip_crc32,
    without_absent_optional_keys,
)
from hpkit.runtime.checkpoints.checkpoint_record import step_dir_name, step_of
from hpkit.runtime.checkpoints.memory_layout import (
    COMPLETE,
    METADATA,
    RANKS,
    RestorePlan,
    choose_step,
    fallback_words,
    holders,
    partner_nodes,
    plan_transfers,
    read_holdings,
    remove_leftovers,
    shard_file,
)
from hpkit.runtime.config import AUTO_EVERY_BUDGET, MemoryCheckpointSpec

# `every: auto` times at least this many steps beside a save's write, and then steps until the write has ended on
# every rank (at most AUTO_MAX_STEPS_BESIDE: past that it waits for the rest), before it chooses. It asks whether
# the write has ended after AUTO_STEPS_BESIDE steps and then at doubling gaps (1, 2, 4, ... steps): one world
# all-reduce a step would cost ~1 s a step at 16k ranks over gloo's ring; this asks ~log2(steps) times.
#
# The save it times is the second: the first pays what only a first save pays (the stager's pinned buffers
# allocated, DCP's plan made, node memory's pages faulted in). On an H200, timed on the first save auto charged a
# save 915 ms (125M) and 5.0 s (1B) and chose 636 and 1,062 steps; timed on the second, 247-423 ms and 0.7-0.9 s,
# and 156-291 and 150-187 steps.
#
# Then it looks once more, over its first whole interval (_review_every): from that interval's save to the next,
# against its steps after the write had ended. One timed save is one sample on a shared host: on an H200 two
# timed 125M saves showed 247 and 423 ms, and the whole intervals under the 291 steps chosen from the second cost
# 8.6 % over plain steps, not the 5 % aimed at.
AUTO_STEPS_BESIDE = 3
AUTO_MAX_STEPS_BESIDE = 1000


class CopyRefused(RuntimeError):
    """Some node had no room for its part of an in-memory step; every rank raises it together."""


_TAG = 4417  # p2p tag of the copies, apart from anything training sends


class _MemoryPlanner(DefaultSavePlanner):
    """Its own class, so that DCP's plan cache (keyed by the planner's class name) is not shared with the
    persistent checkpoints', whose saves may run at the same time on another thread.

    Entries every rank holds alike (AdamW's per-parameter step counters, the trainer's step and RNG) are
    written once, in rank 0's file: DCP's default spreads them over every rank's file, and a restore then
    needs every file on every node (a new node pulled the whole job's state instead of its ranks')."""

    def __init__(self) -> None:
        super().__init__(dedup_save_to_lowest_rank=True, enable_plan_caching=True)


class MemoryCheckpointer:
    def __init__(
        self,
        spec: MemoryCheckpointSpec,
        root: Path,
        node: str,
        log: Callable[[str], None] = print,
        rack: str | None = None,
        persistent: bool = True,
        asking: dist.ProcessGroup | None = None,
    ) -> None:
        self.spec = spec
        self.persistent = persistent  # the run has a checkpoint.dir to fall back to
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.node = node
        self.root = Path(root)
        self.node_dir = self.root / node
        self._log = log
        # Its own gloo group: the copies and their bookkeeping run on a background thread, beside training's
        # collectives and the persistent checkpoint's.
        self.group = dist.new_group(backend="gloo")
        # Where `every: auto` asks whether every rank's first write has ended: a world group on CPU tensors that
        # only the training thread uses (run.py passes the trainer's; None: the default group). Not the copies'
        # group, busy on the background thread meanwhile, nor one more world group (at 16k ranks, 16k more
        # connections a rank).
        self._asking = asking
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (node, rack), group=self.group)
        self.rank_nodes: list[str] = [str(n) for n, _ in gathered]
        racks = {str(n): str(r) for n, r in gathered if r}
        nodes = list(dict.fromkeys(self.rank_nodes))
        self.partners = partner_nodes(nodes, racks, spec.replicas) if len(nodes) > spec.replicas else {}
        held_by = (
            holders(self.rank_nodes, self.partners)
            if self.partners
            else {r: [] for r in range(self.world_size)}
        )
        self.send_to = held_by[self.rank]
        self.receive_from = sorted(r for r, hs in held_by.items() if self.rank in hs)
        self.is_node_leader = self.rank_nodes.index(node) == self.rank
        self._stager = make_stager()
        skip_zip_crc32()  # also where no persistent Checkpointer (which does the same) is made
        self._staging: Any = None
        self._background: threading.Thread | None = None
        self._failure: BaseException | None = None
        # A copy failed before its barrier: the copies' group may be broken for good (gloo's pairs stay closed
        # after a timeout or a lost peer), and every rank's copy failed with it (the barrier needs them all).
        self._renew_group = False
        self.last_step: int | None = None  # newest step complete on every node
        self.dirty = False  # a restore's load failed part-way: the state may be partly overwritten
        self.state_bytes = 0  # this rank's file, as last saved
        self.copy_s = 0.0  # seconds the background spent on the last step's copies
        self.staging_wait_s = 0.0
        # `every: auto`: None until a warm save's costs are known (_choose_every), then the same on every rank.
        self.every: int | None = spec.every if isinstance(spec.every, int) else None
        # The save being timed: the first (it warms up), then the one whose costs choose.
        self._probe: _Probe | None = None
        self._warmed = False  # the first save's write has ended on every rank: the next one is timed
        self.chose_at: int | None = None  # the step at which `every: auto` chose
        self._review: _Review | None = None  # `every: auto`'s first interval under its choice, being timed
        self.reviewed_at: int | None = None  # the step at which it looked again (_review_every)
        self._plain_s: float | None = None  # a step without a save, timed before that save
        self._returned: float | None = None  # when the last save() call returned (perf_counter)
        self._write_s = 0.0  # the last save, from its call to the end of its copies; 0 until they complete
        self._metadata_digest: str | None = None  # of the metadata every node last received
        self._metadata_file: Path | None = None  # this node's copy of it
        if self.is_node_leader:
            self.node_dir.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.root.parent, keep=self.root.name)
        dist.barrier(group=self.group)

    def describe(self) -> str:
        # Without checkpoint.dir nothing persists: a state lost with its partner's copy is lost for good.
        alone = (
            ""
            if self.persistent
            else "; no checkpoint.dir: a state lost with its copy restarts the run from step 0"
        )
        interval = (
            f"every {self.every} step(s)"
            if self.every is not None
            else "at an interval chosen from a save's costs (every: auto)"
        )
        if not self.partners:
            return f"in-memory checkpoints {interval} in {self.root} (one node: no partner copies){alone}"
        pairs = ", ".join(f"{n}->{'+'.join(ps)}" for n, ps in list(self.partners.items())[:4])
        more = ", ..." if len(self.partners) > 4 else ""
        return (
            f"in-memory checkpoints {interval} in {self.root}: each rank's state also on a "
            f"partner node ({pairs}{more}); at the peak {self.spec.host_copies} state-sized copies per rank in RAM{alone}"
        )

    # ----------------------------------------------------------------------------------------------
    # Save

    def due(self, step: int) -> bool:
        # Under `every: auto` each step is due (after one timed without a save) until a save's costs have chosen
        # the interval.
        return step % (self.every or 1) == 0 and step != self.last_step

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Called after every step: saves when the step is due. True if it saved."""
        called = time.perf_counter()
        try:
            return self._save(step, state, called)
        finally:
            self._returned = time.perf_counter()

    def _save(self, step: int, state: dict[str, Any], called: float) -> bool:
        if self.every is None:
            if self._probe is not None:
                # `every: auto`: the steps after a save are timed beside that save's write until it has ended.
                assert self._returned is not None  # set when the probe's save() returned
                self._probe.time_step(self._returned, called, self.staging_wait_s)
                if len(self._probe.beside) < AUTO_STEPS_BESIDE or not self._every_write_ended():
                    return False
                if not self._warmed:
                    # The first save only warmed up (AUTO_STEPS_BESIDE's comment): time a step without a save
                    # again, then save and choose from that save's costs.
                    self._warmed, self._probe, self._plain_s = True, None, None
                    return False
                self._choose_every(step)
                if self.every is not None:
                    self._review = _Review(self.every)
            elif self._plain_s is None:
                # `every: auto` first times a step without a save: the first call marks the step's start.
                if self._returned is None:
                    return False
                self._plain_s = called - self._returned
        elif self._review is not None:
            self._time_review(step, called)
        if not self.due(step):
            return False
        if self._review is not None and self._review.called is None:
            self._review.called = called  # the interval starts with this save's call
        start = time.perf_counter()
        self.wait()
        if self._renew_group:
            self._new_group()
        folder = self.node_dir / step_dir_name(step)
        # No barrier: a folder of this step left by an earlier attempt went in forget_after().
        folder.mkdir(parents=True, exist_ok=True)
        response = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(folder, thread_count=1, sync_files=False),
            planner=_MemoryPlanner(),
            process_group=self.group,
            async_stager=self._stager,
        )
        self._staging = response.staging_completion
        self._background = threading.Thread(
            target=self._finish,
            args=(step, folder, response.upload_completion, start),
            name="hpkit-memory-copy",
            daemon=True,
        )
        self._write_s = 0.0
        self._background.start()
        if self.every is None:
            self._probe = _Probe(start, time.perf_counter(), self.staging_wait_s)
        return True

    def _every_write_ended(self) -> bool:
        """Whether the timed save's write and copies have ended on every rank (one all-reduce on `_asking`), asked
        at doubling gaps (AUTO_STEPS_BESIDE); not asked, False. After AUTO_MAX_STEPS_BESIDE steps it stops
        asking: the rest is waited for, and charged at the later steps' rate."""
        assert self._probe is not None
        if len(self._probe.beside) >= AUTO_MAX_STEPS_BESIDE:
            return True
        since = len(self._probe.beside) - AUTO_STEPS_BESIDE  # 0, 1, 2, ...: asked at 0, 1, 3, 7, 15, ...
        if (since + 1) & since:
            return False
        running = self._background is not None and self._background.is_alive()
        flag = torch.tensor([int(running)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._asking)
        return not flag.item()

    def _choose_every(self, step: int) -> None:
        """`every: auto`, once every rank's second write has ended (at least AUTO_STEPS_BESIDE steps after it began),
        on every rank at the same step: the fewest steps between saves that keep what a save costs training within
        AUTO_EVERY_BUDGET of them, and that give its write to node memory and the partner's copy (which the next
        save waits for) time to finish beside training.

        What a save costs: its call and the optimizer's wait for the staging copy (blocking), and what the write
        took from the steps beside it (write_cost). Every rank takes the largest figures of any rank."""
        probe, self._probe = self._probe, None
        assert probe is not None and self._plain_s is not None
        waited_from = time.perf_counter()
        self.wait()  # nothing left but its bookkeeping, unless it ran past AUTO_MAX_STEPS_BESIDE steps
        waited = time.perf_counter() - waited_from
        if self._renew_group:  # it failed and may have broken the group the figures go over
            self._new_group()
        blocking = probe.returned - probe.called + probe.first_staging_wait
        beside = write_cost(self._plain_s, probe.beside, waited)
        failed = float(self._write_s <= 0)  # set only where the save's copies completed
        figures = torch.tensor([failed, blocking, beside, self._write_s, self._plain_s], dtype=torch.float64)
        # The largest figures of any rank: every rank computes the same interval, and saves at the same steps.
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        failed, blocking, beside, write_s, step_s = figures.tolist()
        if failed:
            return  # no costs to go by: this step saves again and measures again
        step_s = max(step_s, 1e-6)
        cost = blocking + beside
        self.chose_at = step
        self.every = max(1, math.ceil(cost / (AUTO_EVERY_BUDGET * step_s)), math.ceil(write_s / step_s))
        if self.rank == 0:
            self._log(
                f"hpkit train: in-memory checkpoints every {self.every} step(s) (every: auto): a save costs "
                f"training {cost * 1000:.0f} ms ({blocking * 1000:.0f} ms blocking, {beside * 1000:.0f} ms slowed "
                f"beside its write) and writes for {write_s:.2f} s; a step takes {step_s * 1000:.0f} ms"
            )

    def _time_review(self, step: int, called: float) -> None:
        """Under `every: auto`'s choice, the first whole interval: each step after its save's write has ended (on
        this rank) is a plain step; at the next due step, _review_every."""
        review = self._review
        assert review is not None
        if review.called is None:
            return  # its first save is still to come
        if self.due(step):
            self._review_every(step, called, review)
            return
        assert self._returned is not None
        if self._background is None or not self._background.is_alive():
            review.plain.append(called - self._returned)

    def _review_every(self, step: int, called: float, review: _Review) -> None:
        """`every: auto` looks again, once, on every rank at the same step: what its first interval cost training
        (from its save's call to this one's, over as many plain steps) chooses the interval by the same rule as
        _choose_every. Every rank takes the largest figures of any rank."""
        assert review.called is not None
        self._review, self.reviewed_at = None, step
        self.wait()  # this due save would wait for it too; its write's length is one of the figures
        # Their mean, not median: the interval's own steps are summed, and a skewed spread of plain steps (a loaded
        # host's) would be charged to the save as a median's shortfall times the interval.
        plain = statistics.fmean(review.plain) if len(review.plain) >= 3 else self._plain_s or 0.0
        # The plain steps' own excess over their mean sums to zero, so this is the save's call plus the excess of
        # the steps trained beside its write (a validation or a persistent save among those counts against it, as
        # in _choose_every).
        cost = max(0.0, called - review.called - review.every * plain)
        figures = torch.tensor([cost, plain, self._write_s], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self._asking)
        cost, step_s, write_s = figures.tolist()
        step_s = max(step_s, 1e-6)
        every = max(1, math.ceil(cost / (AUTO_EVERY_BUDGET * step_s)), math.ceil(write_s / step_s))
        was, self.every = self.every, every
        if self.rank == 0:
            self._log(
                f"hpkit train: in-memory checkpoints every {every} step(s) (every: auto, {'kept' if every == was else f'was {was}'}"
                f" after its first interval): a save cost training {cost * 1000:.0f} ms over {review.every} steps of "
                f"{step_s * 1000:.0f} ms and wrote for {write_s:.2f} s"
            )

    def wait_for_staging(self) -> None:
        """Block until the state is copied; call before the next optimizer step changes it."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            start = time.perf_counter()
            staging.result()
            self.staging_wait_s += time.perf_counter() - start

    def wait(self) -> None:
        """Finish the step being copied (if any)."""
        self.wait_for_staging()
        if self._background is not None:
            self._background.join()
            self._background = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            # A copy that failed leaves the previous complete step in place: training goes on, and says so.
            if self.rank == 0:
                self._log(
                    f"hpkit train: warning: in-memory checkpoint not completed: {type(failure).__name__}: {failure}"
                )

    def _new_group(self) -> None:
        """A fresh group for the copies, after one failed before its barrier. Every rank's failed there, so every
        rank comes here at the same save: new_group is a collective of the whole world, in the same order. Without
        it, one timed-out copy left every later one failing ("Connection closed by peer") for the rest of the run,
        and recovery would redo every step since."""
        self._renew_group = False
        with contextlib.suppress(Exception):  # a group already unusable may not tear down cleanly
            dist.destroy_process_group(self.group)
        self.group = dist.new_group(backend="gloo")
        if self.rank == 0:
            self._log("hpkit train: in-memory checkpoints: a new group for the copies after the failed one")

    def _finish(self, step: int, folder: Path, upload: Any, called: float) -> None:
        agreed = False  # past the barrier: every rank's copy of this step is in place
        try:
            upload.result()
            start = time.perf_counter()
            unwritten = self._share_metadata(folder)
            own = folder / shard_file(self.rank)
            self.state_bytes = own.stat().st_size
            self._exchange(
                [(h, own) for h in self.send_to],
                [(s, folder / shard_file(s)) for s in self.receive_from],
                unwritten,
            )
            # Every copy is in place on every node before any node calls the step complete.
            dist.barrier(group=self.group)
            agreed = True
            if self.is_node_leader:
                (folder / RANKS).write_text(json.dumps(self.rank_nodes), encoding="utf-8")
                (folder / COMPLETE).write_text(str(step), encoding="utf-8")
                for older in self.node_dir.glob("step-*"):
                    if older.name < folder.name:
                        shutil.rmtree(older, ignore_errors=True)
                # Fresh for remove_leftovers: another job on this node removes only a run untouched for a day.
                os.utime(self.root)
            if self.last_step is None and self.rank == 0:
                peak = self.spec.host_copies * self.state_bytes
                self._log(
                    f"hpkit train: in-memory checkpoint of step {step} complete: rank 0's state {self.state_bytes / 2**20:.1f} "
                    f"MiB, about {peak / 2**20:.1f} MiB of RAM per rank at the peak ({self.spec.host_copies} copies)"
                )
            self.last_step = step
            self.copy_s = time.perf_counter() - start
            self._write_s = time.perf_counter() - called
        except BaseException as exc:
            self._failure = exc
            # Refused room is agreed by every rank on a working group; anything else may have broken it.
            self._renew_group = not agreed and not isinstance(exc, CopyRefused)
            if self.is_node_leader:
                # A step that did not complete is never restored from: its files would stay in node memory,
                # beyond host_copies, one more state each time (every later copy failed where gloo's pairs broke).
                shutil.rmtree(folder, ignore_errors=True)

    def _share_metadata(self, folder: Path) -> OSError | None:
        """Rank 0 wrote the step's metadata on its node; every node keeps one (any node may be the one left). With
        DCP's cached plans it rarely changes between steps: then only its digest travels, and each node copies its
        previous step's, so a step's cost does not grow with the metadata (which grows with the world)."""
        data = (folder / METADATA).read_bytes() if self.rank == 0 else None
        digest = hashlib.sha1(data).hexdigest() if data is not None else None
        unchanged = digest == self._metadata_digest
        blob: list[Any] = [(digest, None if unchanged else data)]
        dist.broadcast_object_list(blob, src=0, group=self.group)
        digest, data = blob[0]
        writes = self.is_node_leader and self.rank != 0
        if writes and data is None and self._metadata_digest == digest and self._metadata_file is not None:
            with contextlib.suppress(OSError):
                data = self._metadata_file.read_bytes()
        need = torch.tensor([int(writes and data is None)])
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.group)
        if need.item():  # some node lost its previous copy: the bytes once more, to all
            blob = [(folder / METADATA).read_bytes() if self.rank == 0 else None]
            dist.broadcast_object_list(blob, src=0, group=self.group)
            data = blob[0]
        if writes:
            try:
                _write_whole(folder / METADATA, data)
            except OSError as exc:  # this node's memory full: agreed on with the copies' own room (_room_for)
                return exc
        self._metadata_digest, self._metadata_file = digest, folder / METADATA
        return None

    def _exchange(
        self,
        sends: list[tuple[int, Path]],
        receives: list[tuple[int, Path]],
        failure: OSError | None = None,
    ) -> None:
        """Point-to-point copies of whole files: sizes first, then the bytes, every send and receive posted
        before any is waited on (no order between pairs can deadlock). Two files between one pair of ranks
        travel in the order both sides list them (gloo keeps the order of one pair's messages of one tag).

        Each file is sent from its own pages in node memory and received straight into the file it becomes
        (both mapped), so no copy of a state passes through the process: the host memory of a save is the
        node folder and the staging copy (`MemoryCheckpointSpec.host_copies`), not three more copies of a
        state as buffers. `failure`: this node could not write its earlier part of the step (the metadata); every
        rank learns of it with the room for the files (_room_for)."""
        payloads = [_mapped(path) for _, path in sends]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in receives]
        works = [
            dist.isend(torch.tensor([data.numel()], dtype=torch.int64), peer, group=self.group, tag=_TAG)
            for (peer, _), data in zip(sends, payloads, strict=True)
        ]
        works += [
            dist.irecv(size, peer, group=self.group, tag=_TAG)
            for (peer, _), size in zip(receives, sizes, strict=True)
        ]
        for work in works:
            work.wait()
        parts = [_part(path) for _, path in receives]
        buffers = self._room_for(parts, [int(size.item()) for size in sizes], failure)
        works = [
            dist.isend(data, peer, group=self.group, tag=_TAG + 1)
            for (peer, _), data in zip(sends, payloads, strict=True)
        ]
        works += [
            dist.irecv(buf, peer, group=self.group, tag=_TAG + 1)
            for (peer, _), buf in zip(receives, buffers, strict=True)
        ]
        for work in works:
            work.wait()
        del payloads, buffers  # unmapped before the files are renamed (or removed)
        for part, (_, path) in zip(parts, receives, strict=True):
            os.replace(part, path)

    def _room_for(self, parts: list[Path], sizes: list[int], failure: OSError | None) -> list[torch.Tensor]:
        """The files this rank receives, their node memory taken up front; every rank agrees whether every node
        found room (and wrote the step's metadata) before any byte travels. A node whose memory is full fails
        here alone: without the agreement its peers waited in the transfer and the barrier until the group's
        timeout (minutes of training stalled at the next save), or a mapped file with no page left behind it
        killed the rank with SIGBUS."""
        buffers: list[torch.Tensor] = []
        if failure is None:
            try:
                buffers = [_mapped(part, size) for part, size in zip(parts, sizes, strict=True)]
            except OSError as exc:
                failure = exc
        try:
            self._agree_on_room(failure)
        except CopyRefused:
            del buffers
            for part in parts:
                part.unlink(missing_ok=True)
            raise
        return buffers

    def _agree_on_room(self, failure: OSError | None) -> None:
        """Every rank learns whether any node failed to write its part (a collective: every rank calls it); where
        one did, CopyRefused naming the nodes is raised on every rank. One flag travels when all went well."""
        ok = torch.tensor([int(failure is None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if ok.item():
            return
        said: list[Any] = [None] * self.world_size
        mine = None if failure is None else f"{self.node}: {failure.strerror or failure}"
        dist.all_gather_object(said, mine, group=self.group)
        raise CopyRefused("no room for the copies on " + "; ".join(dict.fromkeys(s for s in said if s)))

    # ----------------------------------------------------------------------------------------------
    # Restore

    def restore(self, state: dict[str, Any], newer_than: int | None) -> int | None:
        """Load the newest whole in-memory step into `state` if it is newer than `newer_than` (the persistent
        checkpoint's step, or None); returns its step, or None (nothing loaded: resume from checkpoint.dir)."""
        mine = read_holdings(self.node_dir)
        # Without each step's saved rank -> node map: gathered from every rank it would be world x world names.
        slim = [dataclasses.replace(h, rank_nodes=()) for h in mine]
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, (slim, newer_than), group=self.group)
        newer_than = views[0][1]  # rank 0's view of checkpoint.dir decides, as the persistent resume's does
        holdings = {rank: held for rank, (held, _) in enumerate(views)}
        plan: RestorePlan = choose_step(self.world_size, holdings, self.rank_nodes)
        if plan.lost:
            self._name_lost_nodes(plan, holdings, mine)
        if plan.step is None:
            if self.rank == 0 and (plan.lost_step is not None or newer_than is not None):
                # Nothing held at all after training began: every node that held a copy is gone.
                self._log(f"hpkit train: {plan.line(self.rank_nodes, self.persistent)}")
            return None
        if newer_than is not None and plan.step <= newer_than:
            return None
        folder = self.node_dir / step_dir_name(plan.step)
        try:
            loadable, transfers = self._fetch_files(folder, plan, state)
        except CopyRefused as exc:  # every rank raised it together
            if self.rank == 0:
                self._log(
                    f"hpkit train: warning: in-memory step {plan.step} not restored ({exc}); {fallback_words(self.persistent)}"
                )
            return None
        dist.barrier(group=self.group)
        problem = None
        try:
            load_into(state, loadable, folder, self.group)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        verdicts: list[Any] = [None] * self.world_size
        dist.all_gather_object(verdicts, problem, group=self.group)
        bad = [v for v in verdicts if v is not None]
        if bad:
            self.dirty = True
            if self.rank == 0:
                self._log(
                    f"hpkit train: warning: in-memory step {plan.step} did not load ({bad[0]}); {fallback_words(self.persistent)}"
                )
            return None
        self.last_step = plan.step
        if self.rank == 0:
            fetched = len(transfers)
            self._log(
                f"hpkit train: restored step {plan.step} from memory: {fetched} file(s) from partner nodes, "
                "nothing read from checkpoint.dir"
            )
        return plan.step

    def _fetch_files(
        self, folder: Path, plan: RestorePlan, state: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        """The step's metadata, then the files this rank's load reads, on this rank's node: what of `state` the
        step holds, and the transfers made."""
        self._fetch_metadata(folder, plan)
        metadata = dcp.FileSystemReader(folder).read_metadata()
        loadable = without_absent_optional_keys(state, metadata)
        needs: list[Any] = [None] * self.world_size
        dist.all_gather_object(needs, sorted(files_to_read(loadable, metadata)), group=self.group)
        node_files: list[Any] = [None] * self.world_size
        dist.all_gather_object(node_files, set(os.listdir(folder)), group=self.group)
        by_node = {self.rank_nodes[r]: files for r, files in enumerate(node_files)}
        transfers = plan_transfers(dict(enumerate(needs)), by_node, self.rank_nodes)
        self._exchange(
            [(t.dest, folder / t.file) for t in transfers if t.source == self.rank],
            [(t.source, folder / t.file) for t in transfers if t.dest == self.rank],
        )
        return loadable, transfers

    def _name_lost_nodes(self, plan: RestorePlan, holdings: dict[int, Any], mine: list[Any]) -> None:
        """The nodes that held the lost ranks' states, from the saved map of the lowest rank whose node holds the
        incomplete step: one broadcast, only when something is lost."""
        source = min(r for r, held in holdings.items() if any(h.step == plan.lost_step for h in held))
        saved: list[Any] = [
            next((h.rank_nodes for h in mine if h.step == plan.lost_step), ())
            if self.rank == source
            else None
        ]
        dist.broadcast_object_list(saved, src=source, group=self.group)
        plan.lost_nodes = sorted({saved[0][r] for r in plan.lost}) if saved[0] else []

    def _fetch_metadata(self, folder: Path, plan: RestorePlan) -> None:
        """The step's metadata on every node; CopyRefused on every rank where some node had no room for it."""
        have = (folder / METADATA).exists()
        blob: list[Any] = [(folder / METADATA).read_bytes() if self.rank == plan.metadata_from else None]
        dist.broadcast_object_list(blob, src=plan.metadata_from, group=self.group)
        failure = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not have and self.is_node_leader:
                _write_whole(folder / METADATA, blob[0])
        except OSError as exc:
            failure = exc
        self._agree_on_room(failure)

    def forget_after(self, step: int) -> None:
        """Once the run knows the step it resumes from: remove what an earlier attempt left that this attempt's
        saves would write into (an incomplete step, a step after `step`), so that a save needs no barrier and no
        folder marked complete ever mixes two attempts' files."""
        if self.is_node_leader:
            for folder in self.node_dir.glob("step-*"):
                if step_of(folder) > step or not (folder / COMPLETE).exists():
                    shutil.rmtree(folder, ignore_errors=True)
        dist.barrier(group=self.group)

    # ----------------------------------------------------------------------------------------------
    # End

    def close(self, completed: bool) -> None:
        """Finish the copy in flight; a run that completed frees its nodes' memory (a stopped one keeps it for
        the restart)."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if completed:
            dist.barrier(group=self.group)
            if self.is_node_leader:
                shutil.rmtree(self.node_dir, ignore_errors=True)


@dataclasses.dataclass
class _Probe:
    """A save timed under `every: auto`: when it was called and returned (perf_counter), the optimizer's staging
    wait before it, and then each step trained beside its write (seconds, without the staging wait)."""

    called: float
    returned: float
    staging_seen: float  # the optimizer's staging waits so far, as of the last step timed
    beside: list[float] = dataclasses.field(default_factory=list)
    first_staging_wait: float = 0.0  # the optimizer's wait for this save's staging copy

    def time_step(self, began: float, ended: float, staging_wait_s: float) -> None:
        """A step trained from `began` (the last save() call's return) to `ended` (this one's call)."""
        staging, self.staging_seen = staging_wait_s - self.staging_seen, staging_wait_s
        if not self.beside:
            self.first_staging_wait = staging
        self.beside.append(max(ended - began - staging, 1e-9))


@dataclasses.dataclass
class _Review:
    """`every: auto`'s first interval under its choice: the interval, when its save was called (perf_counter; None
    until then), and the steps trained after that save's write had ended (seconds)."""

    every: int
    called: float | None = None
    plain: list[float] = dataclasses.field(default_factory=list)


def write_cost(plain_s: float, beside: list[float], waited_s: float) -> float:
    """Seconds a save's write took from training: each step timed beside it over a step without one (`plain_s`),
    and the rest of the write (`waited_s`: waited for after them, only where it ran past AUTO_MAX_STEPS_BESIDE
    steps) at the later steps' rate.

    The first step after a save is not a rate: on a GPU it carries the staging copy once (an H200: 250-310 ms on
    the one step after each save of 125M and 1B, then 0-25 % on the steps over the rest of a 1-13 s write;
    bench/gpu_write_beside.py). Charged over the whole write, as a first version did, it made the interval 2-3x
    too long on the same figures (the device chose 640 and 2,935 steps). Where ranks train on the cores that
    write (CPU ranks), every step beside the write slows alike, and the rate carries it over the rest."""
    excess = [max(0.0, s - plain_s) for s in beside]
    later = beside[1:]
    rate = sum(excess[1:]) / sum(later) if later else 0.0
    return sum(excess) + rate * waited_s


def _part(path: Path) -> Path:
    """Where a file is written before it is renamed into place (a reader never sees half of one)."""
    return path.with_name(f".{path.name}.{os.getpid()}.part")


def _write_whole(path: Path, data: bytes) -> None:
    tmp = _part(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _mapped(path: Path, size: int | None = None) -> torch.Tensor:
    """A file's bytes as a tensor over its pages (tmpfs: the node memory it already takes, not a copy);
    with `size`, a new file of that many bytes, written through the tensor."""
    if size is None:
        size = path.stat().st_size
        shared = False
    else:
        with path.open("wb") as f:
            f.truncate(size)
            if size:
                # The pages taken now: on a full tmpfs a sparse file maps fine and the first write past the
                # free pages kills the process with SIGBUS; reserved, it is ENOSPC here.
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot reserve
                        raise
        shared = True
    if size == 0:  # nothing to map
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=shared, size=size, dtype=torch.uint8)
