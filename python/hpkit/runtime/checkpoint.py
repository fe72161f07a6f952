"""Distributed checkpoints (torch.distributed.checkpoint): model, optimizer, step, data position, RNG.

Layout under the checkpoint directory:
    step-00000100/     a complete checkpoint (DCP files + .metadata)
    step-00000200.tmp/ one being written; never read, removed at the next start
    step-00000050.<id>.deleting/
                       pruned (beyond `keep`) or stale, being removed by a background thread
    latest             the name of the newest complete checkpoint

Every rank writes into the .tmp directory; only when all have finished does rank 0 rename it and then
replace `latest` (both atomic renames), so a crash at any point leaves the previous checkpoint as the
one a restart finds. Model and optimizer state are keyed by parameter name with DTensor placements,
so DCP can load them into a different parallel layout or world size.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hpkit.errors import HpkitError
from hpkit.runtime.data import DataLoader

_STEP_DIR = re.compile(r"^step-(\d+)$")
_DELETING = ".deleting"  # suffix of pruned checkpoints while a background thread removes them
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(HpkitError):
    """A checkpoint could not be written; the previous complete one is untouched."""


class ModelState:
    """DCP Stateful for this rank's model part(s): keys are the full model's parameter names."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part, options=_OPTIONS))
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


@dataclass
class TrainState:
    """Step, data position and RNG. Every rank seeds alike and draws in lockstep, so one copy suffices."""

    step: int
    loader: DataLoader

    def state_dict(self) -> dict[str, Any]:
        state = {
            "step": torch.tensor(self.step),
            "data_position": torch.tensor(self.loader.position),
            "rng_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loader.position = int(state["data_position"])
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def committed(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir() and (entry / ".metadata").is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def find_latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if pointer.is_file():
        target = root / pointer.read_text(encoding="utf-8").strip()
        if _STEP_DIR.match(target.name) and (target / ".metadata").is_file():
            return target
    # `latest` lags the rename by one atomic write; a committed directory is complete by construction.
    done = committed(root)
    return done[-1][1] if done else None


class Checkpointer:
    def __init__(
        self, root: str | Path, keep: int, async_save: bool, rank: int, writer_threads: int = 1
    ) -> None:
        self.root = Path(root)
        self.keep = keep
        self.async_save = async_save
        self.is_rank0 = rank == 0
        self.writer_threads = writer_threads
        # A separate gloo group: DCP's coordination runs on CPU, and an async save's collectives run in a
        # background thread, where they must not interleave with training's collectives.
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[Any, Path, Path] | None = None
        self._reapers: list[threading.Thread] = []
        self._staging: Any = None  # Future of the async save's copy to host memory
        self.staging_wait_s = 0.0  # time training spent waiting for it (benchmarks read this)
        # One stager for the whole run: it keeps its host buffers between saves, so only the first
        # save pays for allocating (and on GPUs pinning) them.
        self._stager = _make_stager() if async_save else None
        # torch.save's zip CRC32s cost half of serialising each tensor (measured: 232 vs 120 ms per
        # 360 MB), and torch.load never checks them: a flipped bit loads silently either way. Process-
        # wide, which is fine for a training process; completeness comes from the commit protocol.
        torch.serialization.set_crc32_options(False)

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

    def load(self, state: dict[str, Any], path: Path) -> None:
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)

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
            room = f" ({shutil.disk_usage(self.root).free / 2**20:.0f} MiB free now)"
        except OSError:
            room = ""
        return f"{kept}. Check that {self.root} is writable and has room{room}, then resubmit to resume"

    def _failed(self, tmp: Path, exc: BaseException) -> CheckpointError:
        if self.is_rank0:  # every rank saw the collective fail, so none is still writing here
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(
            f"could not write checkpoint {tmp.name[:-4]}: {_first_failure(exc)}; {self._advice()}"
        )

    def save(self, step: int, state: dict[str, Any]) -> None:
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
        return dcp.FileSystemWriter(path, thread_count=self.writer_threads)

    def wait_for_staging(self) -> None:
        """Block until an async save has copied the state; call before anything changes it."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            start = time.perf_counter()
            staging.result()
            self.staging_wait_s += time.perf_counter() - start

    def wait(self) -> None:
        """Finish an async save (if any) and commit it."""
        self.wait_for_staging()
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        try:
            future.result()
        except (OSError, CheckpointException) as exc:
            raise self._failed(tmp, exc) from None
        self._commit(tmp, final)

    def _commit(self, tmp: Path, final: Path) -> None:
        dist.barrier(group=self.group)  # every rank's shards and rank 0's .metadata are on disk

        def publish() -> None:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = self.root / "latest.tmp"
            pointer.write_text(final.name + "\n", encoding="utf-8")
            _fsync(pointer)
            os.replace(pointer, self.root / "latest")
            _fsync_dir(self.root)
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
        self.wait()
        for thread in self._reapers:
            thread.join()  # a daemon thread cut off at exit would leave half a checkpoint on disk
        if self._stager is not None:
            self._stager.close()
            self._stager = None


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


def _make_stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=on_gpu,
        )
    )


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
