"""Distributed checkpoints (torch.distributed.checkpoint): model, optimizer, step, data position, RNG.

Layout under the checkpoint directory:
    step-00000100/     a complete checkpoint (DCP files + .metadata + hpkit-commit.json, the record of
                       every file's size and CRC-32C; without it a directory is never resumed from)
    step-00000200.tmp/ one being written; never read, removed at the next start
    step-00000050.<id>.deleting/
                       pruned (beyond `keep`) or stale, being removed by a background thread
    latest             the name of the newest complete checkpoint

Every rank writes into the .tmp directory, checksumming as it writes; only when all have finished does
rank 0 write the commit record, rename the directory and then replace `latest` (atomic renames), so a
crash at any point leaves the previous checkpoint as the one a restart finds. On resume, each rank
verifies the files it is about to read, and the ranks agree on every verdict: they all take the same
checkpoint or all skip it, so no rank trains on while another is still loading. Model and optimizer state are keyed by parameter name with DTensor placements,
so DCP can load them into a different parallel layout or world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from hpkit.errors import HpkitError
from hpkit.runtime.checkpoints.checkpoint_record import (
    RECORD_NAME,
    STEP_DIR,
    ChecksumWriter,
    CommitRecord,
    DigestLog,
    FileDigest,
    RecordError,
    read_record,
    step_dir_name,
    step_of,
    verify_files,
    write_record,
)
from hpkit.runtime.config import CheckpointSpec

_STEP_DIR = STEP_DIR
_DELETING = ".deleting"  # suffix of pruned checkpoints while a background thread removes them
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(HpkitError):
    """A checkpoint could not be written; the previous complete one is untouched."""


class ModelState:
    """DCP Stateful for this rank's model part(s): keys are the full model's parameter names.

    `trainable_only` (LoRA): only the parameters that train; the frozen base is not saved (it is
    model.init_from's, or the seed's, and the commit record names it)."""

    def __init__(self, parts: list[nn.Module], trainable_only: bool = False) -> None:
        self.parts = parts
        self.options = StateDictOptions(
            flatten_optimizer_state_dict=True, ignore_frozen_params=trainable_only
        )

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part, options=self.options))
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


class OptimizerState:
    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.parts, self.optimizers = parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            merged.update(get_optimizer_state_dict(part, opt, options=_OPTIONS))
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, opt, state, options=_OPTIONS)


def committed(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir() and (entry / RECORD_NAME).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def find_latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if pointer.is_file():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if _STEP_DIR.match(target.name) and (target / RECORD_NAME).is_file():
            return target
    # `latest` lags the rename by one atomic write; a committed directory is complete by construction.
    done = committed(root)
    return done[-1][1] if done else None


# Each checkpoint file streams to disk through this much page cache (`page_cache.StreamingWriteback`):
# its pages are written back and dropped behind the writer, so a save reuses a few MiB of cache
# instead of allocating its whole size anew (slow on VMs that hand free memory back to the host)
# and the disk works while tensors are still being serialised. 0: the whole file waits for its fsync.
# Measured on the 2-vCPU test VM in BENCHMARKS.md, P4; bench_checkpoint.py keeps measuring both.
WRITEBACK_BYTES = 16 << 20
# torch.save writes each tensor as a zip of ~11 pieces, most of them a few bytes of header; this
# buffer gathers them before they reach the checksum (Python code), and larger writes go straight
# through. torch.save flushes after every tensor, so a bigger buffer would not gather more.
_BUFFER_BYTES = 64 << 10


class _FlushingBufferedWriter(io.BufferedWriter):
    """DCP fsyncs `stream.fileno()` without flushing the stream first: flush before handing it out."""

    def fileno(self) -> int:
        self.flush()
        return super().fileno()


class ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, with every file written checksummed on its way to disk."""

    def __init__(self, log: DigestLog, writeback_bytes: int = WRITEBACK_BYTES) -> None:
        super().__init__()
        self.log = log
        self.writeback_bytes = writeback_bytes

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        # file <- checksum (one call per buffer flush or large write) <- buffer <- DCP/torch.save
        with Path(path).open(mode, buffering=0) as raw:
            checksummed = ChecksumWriter(
                raw, lambda w: self.log.add(name, FileDigest(w.size, w.crc)), self.writeback_bytes
            )
            stream = _FlushingBufferedWriter(checksummed, buffer_size=_BUFFER_BYTES)
            try:
                yield stream
            finally:
                stream.close()  # flushes, then closes the checksum, which records the digest

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.log.rename(Path(path).name, Path(new_path).name)


class Checkpointer:
    """Saves on the spec's policy (interval, final, on signal), commits atomically, resumes by agreement."""

    def __init__(
        self,
        spec: CheckpointSpec,
        root: str | Path,
        rank: int,
        layout: dict[str, int] | None = None,
        log: Callable[[str], None] = print,
        on_commit: Callable[[CommitRecord, Path], None] | None = None,
        model: dict[str, Any] | None = None,
        saving: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        refusal: Callable[[CommitRecord, Path], str | None] | None = None,
    ) -> None:
        self.spec = spec
        self.root = Path(root)
        self.keep = spec.keep
        self.async_save = spec.async_save
        self.rank = rank
        self.is_rank0 = rank == 0
        self.writer_threads = spec.writer_threads
        self.layout = dict(layout or {})
        self.model = model  # recorded in each commit record (`hpkit ckpt export` reads it)
        # Why a checkpoint must not be resumed at all (LoRA adapters of another base): the run stops.
        self._refusal = refusal
        self.world_size = dist.get_world_size()
        self._log = log
        self._on_commit = on_commit  # rank 0, after the rename: the metrics file records each checkpoint
        # Entered around every call that blocks on a save's I/O (a save, the wait for an async save's
        # staging or upload, close): the run's hang watchdog judges that time as a save, not a step.
        self._saving = saving
        self.last_saved_step: int | None = None
        self._digests: DigestLog | None = None
        # A separate gloo group: DCP's coordination runs on CPU, and an async save's collectives run in a
        # background thread, where they must not interleave with training's collectives.
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[Any, Path, Path] | None = None
        self._reapers: list[threading.Thread] = []
        self._staging: Any = None  # Future of the async save's copy to host memory
        self.staging_wait_s = 0.0  # time training spent waiting for it (benchmarks read this)
        # One stager for the whole run: it keeps its host buffers between saves, so only the first
        # save pays for allocating (and on GPUs pinning) them.
        self._stager = make_stager() if self.async_save else None
        skip_zip_crc32()

        def prepare() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._reap(list(self.root.glob("step-*.tmp")))
            for leftover in self.root.glob(f"step-*{_DELETING}"):  # already aside, under unique names
                shutil.rmtree(leftover, ignore_errors=True)

        self._on_rank0(prepare, f"cannot use checkpoint.dir {self.root}")

    def latest(self) -> Path | None:
        return find_latest(self.root)

    def candidates(self) -> list[Path]:
        """Checkpoints to try on resume, newest first: `latest`, then every other committed one."""
        latest = self.latest()
        others = [path for _, path in reversed(committed(self.root)) if path != latest]
        return ([latest] if latest else []) + others

    # ----------------------------------------------------------------------------------------------
    # Resume

    def restore(self, state: dict[str, Any]) -> tuple[Path | None, bool]:
        """Load the newest usable checkpoint into `state`; every rank returns the same answer.

        Returns (the checkpoint loaded or None, whether a failed attempt may have left `state` partly
        overwritten). Each candidate is checked before any rank reads from it: the commit record, then
        the CRC-32C of each file this rank will read. Verdicts are all-gathered, so a bad file seen by
        one rank makes every rank skip that checkpoint together; so is the outcome of the load itself,
        whose last part (applying each Stateful) runs on each rank alone.
        """
        dirty = False
        candidates = self._agreed_candidates()
        if self._refusal is not None:
            refused = self._agree(self._refused(candidates))
            if refused is not None:
                raise CheckpointError(refused.rsplit(" (seen by ", 1)[0])
        for path in candidates:
            local, loadable = self._local_problem(state, path)
            problem = self._agree(local)
            if problem is None:
                try:
                    load_into(state, loadable, path, self.group)
                    local = None
                except CheckpointException as exc:  # raised on every rank alike
                    local = _first_failure(exc)
                except Exception as exc:  # a Stateful's load_state_dict: this rank alone
                    local = f"{type(exc).__name__}: {exc}"
                problem = self._agree(local)
                dirty = dirty or problem is not None
            if problem is None:
                self.last_saved_step = step_of(path)
                return path, False
            if self.is_rank0:
                self._log(f"hpkit train: warning: skipping checkpoint {path}: {problem}")
        return None, dirty

    def _refused(self, candidates: list[Path]) -> str | None:
        """The refusal of the newest candidate whose record reads (an unreadable one is skipped later)."""
        assert self._refusal is not None
        for path in candidates:
            try:
                record = read_record(path)
            except RecordError:
                continue
            return self._refusal(record, path)
        return None

    def _agreed_candidates(self) -> list[Path]:
        # Rank 0's view decides: a rank whose filesystem shows another list (a node-local directory, a
        # lagging NFS cache) then fails that candidate's check instead of trying a different one.
        listing: list[Any] = [[str(p) for p in self.candidates()] if self.is_rank0 else None]
        dist.broadcast_object_list(listing, src=0, group=self.group)
        return [Path(p) for p in listing[0]]

    def _agree(self, problem: str | None) -> str | None:
        """Every rank's verdict, gathered: None only when no rank has a problem."""
        verdicts: list[Any] = [None] * self.world_size
        dist.all_gather_object(verdicts, problem, group=self.group)
        bad = [rank for rank, v in enumerate(verdicts) if v is not None]
        if not bad:
            return None
        shown = ",".join(map(str, bad[:8])) + (",..." if len(bad) > 8 else "")
        who = "every rank" if len(bad) == self.world_size else f"rank {shown} of {self.world_size}"
        return f"{verdicts[bad[0]]} (seen by {who})"

    def _local_problem(self, state: dict[str, Any], path: Path) -> tuple[str | None, dict[str, Any]]:
        """Why this rank cannot load `path` (one phrase naming the file and what differed), or None; and the
        state to load it into (`without_absent_optional_keys`), from the one read of its metadata here."""
        loadable = state
        try:
            record = read_record(path)
            problems = verify_files(path, record, [".metadata"])
            if not problems:
                metadata = dcp.FileSystemReader(path).read_metadata()
                loadable = without_absent_optional_keys(state, metadata)
                problems = verify_files(path, record, files_to_read(loadable, metadata))
        except RecordError as exc:
            return str(exc), loadable
        except Exception as exc:  # the checkpoint does not fit this model (missing keys, shapes)
            return f"cannot plan the load: {type(exc).__name__}: {exc}", loadable
        return ("; ".join(problems) if problems else None), loadable

    def _on_rank0(self, action: Callable[[], None], what: str) -> None:
        """Run a filesystem change on rank 0; if it fails, every rank raises (none is left waiting)."""
        outcome: list[str | None] = [None]
        if self.is_rank0:
            try:
                action()
            except OSError as exc:
                outcome = [f"{what}: {exc}"]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0] is not None:
            raise CheckpointError(f"{outcome[0]}; {self._advice()}")

    def _advice(self) -> str:
        latest = self.latest()
        kept = (
            f"the newest complete checkpoint is still {latest}" if latest else "no checkpoint is complete yet"
        )
        try:
            room = f"{shutil.disk_usage(self.root).free / 2**20:.0f} MiB free now"
        except OSError:
            room = ""
        # A full disk does not always say so: torch.save's writer reports ENOSPC as "unexpected pos N vs M".
        if latest and (held := _bytes_in(latest)):
            room = f"{room}{'; ' if room else ''}the newest checkpoint holds {held / 2**20:.0f} MiB"
        room = f" ({room})" if room else ""
        return f"{kept}. Check that {self.root} is writable and has room{room}, then resubmit to resume"

    def _failed(self, tmp: Path, exc: BaseException) -> CheckpointError:
        if self.is_rank0:  # every rank saw the collective fail, so none is still writing here
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(
            f"could not write checkpoint {tmp.name[:-4]}: {_first_failure(exc)}; {self._advice()}"
        )

    # ----------------------------------------------------------------------------------------------
    # Save

    def due(self, step: int, *, final: bool = False, forced: bool = False) -> bool:
        """The save policy: on a signal, every `interval` steps, and after the last step (save_final)."""
        if step == self.last_saved_step:
            return False
        return forced or step % self.spec.interval == 0 or (final and self.spec.save_final)

    def save(self, step: int, state: dict[str, Any], *, final: bool = False, forced: bool = False) -> bool:
        """Save `state` as step `step` if the policy says so; returns whether it did."""
        if not self.due(step, final=final, forced=forced):
            return False
        with self._saving():
            self._save(step, state)
        self.last_saved_step = step
        return True

    def _save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")

        def make_tmp() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        self._on_rank0(make_tmp, f"could not create {tmp}")
        try:
            self._write(state, tmp, final)
        except (OSError, CheckpointException) as exc:
            raise self._failed(tmp, exc) from None

    def _write(self, state: dict[str, Any], tmp: Path, final: Path) -> None:
        if self.async_save:
            # The copy to host memory runs in the background too: forward and backward do not touch
            # the parameters or optimizer state, so only the next optimizer step must wait for it
            # (`wait_for_staging`).
            response = dcp.async_save(
                state,
                storage_writer=self._writer(tmp),
                planner=_planner(),
                process_group=self.group,
                async_stager=self._stager,
            )
            self._staging = response.staging_completion
            self._pending = (response.upload_completion, tmp, final)
        else:
            dcp.save(state, storage_writer=self._writer(tmp), planner=_planner(), process_group=self.group)
            self._commit(tmp, final)

    def _writer(self, path: Path) -> Any:
        writer = dcp.FileSystemWriter(path, thread_count=self.writer_threads)
        # Checksums are taken as the bytes go out: a save never reads its files back.
        self._digests = DigestLog()
        writer.fs = ChecksummingFileSystem(self._digests)
        return writer

    def wait_for_staging(self) -> None:
        """Block until an async save has copied the state; call before anything changes it."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            start = time.perf_counter()
            with self._saving():
                staging.result()
            self.staging_wait_s += time.perf_counter() - start

    def wait(self) -> None:
        """Finish an async save (if any) and commit it."""
        self.wait_for_staging()
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        with self._saving():
            try:
                future.result()
            except (OSError, CheckpointException) as exc:
                raise self._failed(tmp, exc) from None
            self._commit(tmp, final)

    def _commit(self, tmp: Path, final: Path) -> None:
        # Gathering every rank's digests also tells rank 0 that all shards and its .metadata are on disk.
        mine = dict(self._digests.files) if self._digests else {}
        gathered: list[Any] = [None] * self.world_size if self.is_rank0 else []
        dist.gather_object(mine, gathered if self.is_rank0 else None, dst=0, group=self.group)

        def publish() -> None:
            files: dict[str, FileDigest] = {}
            for part in gathered:
                files.update(part or {})
            record = CommitRecord(
                step_of(final), files, self.world_size, self.layout, time.time(), self.model
            )
            write_record(tmp, record)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = self.root / "latest.tmp"
            pointer.write_text(final.name + "\n", encoding="utf-8")
            _fsync(pointer)
            os.replace(pointer, self.root / "latest")
            _fsync_dir(self.root)
            if self._on_commit is not None:
                self._on_commit(record, final)
            # Unlinking a few GB takes long enough to stall training: rename them out of the resume path
            # (atomic) now, delete them in the background.
            self._reap([path for _, path in committed(self.root)[: -self.keep]])

        self._on_rank0(publish, f"could not publish checkpoint {final.name}")

    def _reap(self, paths: list[Path]) -> None:
        """Rename `paths` aside (a unique name: a later save may reuse theirs), then delete them in a thread."""
        doomed = []
        for path in paths:
            aside = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{_DELETING}")
            os.replace(path, aside)
            doomed.append(aside)
        if not doomed:
            return

        def remove() -> None:
            for path in doomed:
                shutil.rmtree(path, ignore_errors=True)

        thread = threading.Thread(target=remove, name="hpkit-checkpoint-reaper", daemon=True)
        thread.start()
        self._reapers = [t for t in self._reapers if t.is_alive()] + [thread]

    def close(self) -> None:
        with self._saving():
            self.wait()
            for thread in self._reapers:
                thread.join()  # a daemon thread cut off at exit would leave half a checkpoint on disk
            if self._stager is not None:
                self._stager.close()
                self._stager = None


class _Without:
    """A Stateful that loads without some of its keys."""

    def __init__(self, inner: Stateful, absent: set[str]) -> None:
        self.inner, self.absent = inner, absent

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.inner.state_dict().items() if k not in self.absent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def without_absent_optional_keys(state: dict[str, Any], metadata: Any) -> dict[str, Any]:
    """`state` for loading a checkpoint whose metadata lacks some keys that a Stateful names as optional
    (`optional_state_keys`): a checkpoint saved on a CPU has no CUDA RNG state, and DCP refuses a load whose
    state asks for a key the checkpoint does not hold ("Missing key in checkpoint state_dict")."""
    saved = set(metadata.state_dict_metadata)
    wrapped = {}
    for name, value in state.items():
        absent = {k for k in getattr(value, "optional_state_keys", ()) if f"{name}.{k}" not in saved}
        if absent and isinstance(value, Stateful):
            wrapped[name] = _Without(value, absent)
    return {**state, **wrapped} if wrapped else state


def load_into(state: dict[str, Any], loadable: dict[str, Any], path: Path, group: Any) -> None:
    """DCP's load of `loadable` (`state`, or `without_absent_optional_keys` of it) from the checkpoint in `path`,
    with what it loaded back in `state`: DCP puts loaded objects (BytesIO, plain values) into the dict it was
    given. Both tiers load here, so both read with ParallelReader."""
    dcp.load(loadable, storage_reader=ParallelReader(path), process_group=group)
    if loadable is not state:
        state.update({k: v for k, v in loadable.items() if not isinstance(v, _Without)})


# Threads each rank reads its checkpoint's tensors with. DCP's reader reads them one after another, each through
# torch.load of a copy of its bytes: 1.4-1.8 GB/s from tmpfs on this project's 2-vCPU VM for 1.5 GiB, 2.9-5.2 GB/s
# with 2 threads, 3.4-3.9 with 4 (the files are read, unpickled and copied into the state while another is); on
# an H200 host one thread restored 16.75 GiB from node memory in 16.4-18.6 s (1.0 GB/s), 4 threads in 4.7-5.5 s
# (3.3-3.9 GB/s; 125M's 1.5 GiB 1.79 -> 0.70-0.77 s; BENCHMARKS.md). Ranks share a node's cores, hence few.
READ_THREADS = 4


class ParallelReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, whose reads run on READ_THREADS threads: the tensors of the plan, split into runs
    of about equal bytes in file order, each run read by DCP's own read_data with a stream of its own. Objects
    other than tensors (small: RNG and data loader states) are read first, in this thread, as DCP reads them, since
    loading them writes into the state dict's nesting."""

    def read_data(self, plan: LoadPlan, planner: Any) -> torch.futures.Future[None]:
        objects = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        tensors = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        if objects:
            super().read_data(dataclasses.replace(plan, items=objects), planner).wait()
        runs = _runs(tensors, lambda item: self.storage_data[item.storage_index], READ_THREADS)
        if len(runs) == 1:
            super().read_data(dataclasses.replace(plan, items=runs[0]), planner).wait()
        elif runs:
            with ThreadPoolExecutor(len(runs), thread_name_prefix="hpkit-read") as pool:
                done = [
                    pool.submit(
                        super(ParallelReader, self).read_data, dataclasses.replace(plan, items=run), planner
                    )
                    for run in runs
                ]
                for future in done:
                    future.result().wait()  # raises what its read raised
        finished: torch.futures.Future[None] = torch.futures.Future()
        finished.set_result(None)
        return finished


def _runs(items: list[Any], where: Callable[[Any], Any], count: int) -> list[list[Any]]:
    """`items` in file order (`where` gives each one's relative_path, offset and length), cut into at most `count`
    consecutive runs of about equal bytes."""
    ordered = sorted(items, key=lambda item: (where(item).relative_path, where(item).offset))
    total = sum(where(item).length for item in ordered)
    runs: list[list[Any]] = []
    run: list[Any] = []
    taken = 0
    for item in ordered:
        length = where(item).length
        target = total * (len(runs) + 1) / count  # where this run should end, in bytes from the start
        # A run ends before an item that would take it further past its end than it falls short without it.
        if run and len(runs) < count - 1 and taken + length - target > target - taken:
            runs.append(run)
            run = []
        run.append(item)
        taken += length
    if run:
        runs.append(run)
    return runs


def files_to_read(state: dict[str, Any], metadata: Any) -> set[str]:
    """The files of a checkpoint (its `metadata`) that loading `state` on this rank reads: DCP's own local plan."""
    plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(plain, metadata, False)
    plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


def _first_failure(exc: BaseException) -> str:
    """The first rank's error, without DCP's per-rank tracebacks."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _trace) = min(exc.failures.items())
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def _planner() -> Any:
    # Every save of a run has the same layout: after the first, ranks send only "unchanged" to the
    # coordinator instead of their whole plan, which saves a gather and scatter of plans per save.
    return DefaultSavePlanner(enable_plan_caching=True)


def skip_zip_crc32() -> None:
    """DCP writes each tensor with torch.save, whose zip CRC32s cost half of serialising it (measured: 232 vs 120
    ms per 360 MB; 1.53 vs 0.65 s for an in-memory checkpoint's 1.5 GiB) and which torch.load never checks.
    Integrity comes from the persistent checkpoint's commit record (CRC-32C, taken as the bytes are written,
    checked before a load); in-memory copies live in node RAM beside the run. Process-wide, which is fine
    for a training process."""
    torch.serialization.set_crc32_options(False)


def make_stager() -> Any:
    """The stager every async save of one checkpointer reuses: pinned host buffers on a GPU (the staging copy
    runs on its own stream), a plain copy on the CPU."""
    on_gpu = torch.cuda.is_available()
    return _ReusableStager(
        StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=on_gpu,
        )
    )


class _ReusableStager(DefaultStager):
    """DCP's DefaultStager, kept whole between the saves of a run on every torch build.

    Some builds (torch 2.11 as shipped in a CUDA image, and 2.13 nightlies) close the inner StateDictStager at the
    end of each stage, to break a reference cycle of a stager made for one save. That empties its deepcopy
    dispatch table, so the next stage failed on the state's first dict with `KeyError: <class 'type'>` (on the
    GPU lane, H200 with torch 2.11, every in-memory and async save after the first), and drops its cached host
    buffers, so each save would pin its buffers anew. This stager lives for the run and is closed at its end
    (close below): the close inside a stage is skipped.
    """

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        inner = getattr(self, "_state_dict_stager", None)
        if inner is None:  # a build laid out otherwise: nothing to keep
            return super()._stage(state_dict, **kwargs)
        inner.close = _keep_open  # the instance's attribute, found before the class's method
        try:
            return super()._stage(state_dict, **kwargs)
        finally:
            del inner.close


def _keep_open() -> None:
    """Stands in for StateDictStager.close during a stage (see _ReusableStager)."""


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_in(folder: Path) -> int:
    """The bytes of the files directly in `folder` (a DCP checkpoint is flat); 0 where it cannot be read."""
    try:
        with os.scandir(folder) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file(follow_symlinks=False))
    except OSError:
        return 0
