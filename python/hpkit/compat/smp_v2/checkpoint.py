"""SMP v2's checkpoint API on torch DCP, each save committed atomically with hpkit's checksummed record.

A save writes `<checkpoint_id>.tmp/`, the coordinator digests every file (CRC-32C) into the commit record and
renames the folder to `<checkpoint_id>`; a load verifies the record and the files first, so a torn or
flipped checkpoint is refused in one line instead of loading garbage. The state dicts are the script's own:
`model.state_dict()` of the FSDP2 model holds DTensor shards, so checkpoints reshard to other layouts.
Used by `torch.sagemaker.distributed.checkpoint` (state_dict_saver / state_dict_loader) and the legacy
`torch.sagemaker.distributed.fsdp.checkpoint`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpkit.compat.smp_v2.state import bad_config
from hpkit.runtime.checkpoints.checkpoint_record import (
    CommitRecord,
    RecordError,
    digest_file,
    read_record,
    verify_files,
    write_record,
)

WHERE = "tsm.checkpoint"


def _path(checkpoint_id: str | os.PathLike | None) -> Path:
    if checkpoint_id is None:
        raise bad_config("pass checkpoint_id=<folder> (storage writers and readers are not supported)", WHERE)
    return Path(checkpoint_id)


def _commit(tmp: Path, final: Path, step: int, world: int) -> None:
    files = {p.name: digest_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    write_record(tmp, CommitRecord(step=step, files=files, world_size=world, created=time.time()))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    **_ignored: Any,
) -> None:
    final = _path(checkpoint_id)
    tmp = final.with_name(final.name + ".tmp")
    is_coordinator = dist.get_rank() == coordinator_rank
    if is_coordinator:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=process_group)
    dcp.save(state_dict, checkpoint_id=str(tmp), process_group=process_group)
    dist.barrier(group=process_group)
    if is_coordinator:
        step = int(state_dict.get("total_steps", state_dict.get("step", 0)) or 0)
        _commit(tmp, final, step, dist.get_world_size(process_group))
    dist.barrier(group=process_group)


def async_save(
    state_dict: dict[str, Any], checkpoint_id: str | os.PathLike | None = None, **kwargs: Any
) -> None:
    # Saved before returning: hpkit's own runtime overlaps saves with training (checkpoint.async_save);
    # here a save finishes in the call, and maybe_finalize_async_calls has nothing left to wait for.
    save(state_dict, checkpoint_id=checkpoint_id, **kwargs)


def maybe_finalize_async_calls(
    blocking: bool = True, process_group: Any = None, **_ignored: Any
) -> list[Any]:
    return []


def _verify(final: Path, process_group: dist.ProcessGroup | None, coordinator_rank: int) -> None:
    problem = [""]
    if dist.get_rank() == coordinator_rank:
        try:
            record = read_record(final)
            bad = verify_files(final, record)
            problem[0] = f"{final}: {bad[0]}" if bad else ""
        except RecordError as exc:
            problem[0] = f"{final}: {exc}"
    dist.broadcast_object_list(problem, src=coordinator_rank, group=process_group)
    if problem[0]:
        raise bad_config(f"cannot load {problem[0]}", WHERE)


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    **_ignored: Any,
) -> None:
    final = _path(checkpoint_id)
    _verify(final, process_group, coordinator_rank)
    dcp.load(state_dict, checkpoint_id=str(final), process_group=process_group)
