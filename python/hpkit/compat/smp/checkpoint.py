"""Checkpoints: smp.save_checkpoint / smp.resume_from_checkpoint on DCP through hpkit's Checkpointer
(checksummed commit record, atomic `latest`, resharding on load), and smp.save / smp.load for single
objects.

save_checkpoint(path, tag) writes <path>/<tag>/step-00000000 and names the tag in <path>/newest. DCP
files hold each rank's own shards and load into any layout, so partial=True and partial=False write
the same thing. smp.save/smp.load keep SMP's file convention: partial=True writes one file per model
shard (<f>_<pp_rank>_<tp_rank>, by the first replica only), partial=False one file by rank 0.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpkit.compat.smp import topology
from hpkit.compat.smp.unsupported import bad_setting

_NEWEST = "newest"


def _partial_name(f: str | os.PathLike) -> str:
    return f"{os.fspath(f)}_{topology.pp_rank()}_{topology.tp_rank()}"


def save(obj: Any, f: str | os.PathLike, partial: bool = True, **_kwargs: Any) -> None:
    if partial:
        if topology.dp_rank() == 0:
            torch.save(obj, _partial_name(f))
    elif topology.rank() == 0:
        torch.save(obj, f)
    topology.barrier()


def load(f: str | os.PathLike, partial: bool = True, map_location: Any = None, **_kwargs: Any) -> Any:
    return torch.load(_partial_name(f) if partial else f, map_location=map_location, weights_only=False)


def _checkpointer(root: Path, keep: int) -> Any:
    from hpkit.runtime.checkpoints.checkpoint import Checkpointer
    from hpkit.runtime.config import CheckpointSpec

    layout = {"tp": topology.tp_size(), "pp": topology.pp_size(), "dp_replicate": topology.dp_size()}
    return Checkpointer(CheckpointSpec(dir=str(root), keep=keep), root, topology.rank(), layout=layout)


def _state(model: Any, optimizer: Any, user_content: Any) -> dict[str, Any]:
    from hpkit.runtime.checkpoints.checkpoint import ModelState, OptimizerState

    state: dict[str, Any] = {}
    if model is not None:
        state["model"] = ModelState([model.local_module])
    if optimizer is not None:
        state["optimizer"] = OptimizerState(
            [model.local_module], [getattr(optimizer, "optimizer", optimizer)]
        )
    # DCP stores BytesIO values as they are: any picklable user content fits, None included.
    state["user_content"] = io.BytesIO(pickle.dumps(user_content))
    return state


def save_checkpoint(
    path: str | os.PathLike,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    num_kept_partial_checkpoints: int | None = None,
    **_kwargs: Any,
) -> None:
    from hpkit.compat.smp.model import current_model

    model = model or current_model()
    if optimizer is not None and model is None:
        bad_setting("save_checkpoint: saving an optimizer needs the smp.DistributedModel")
    root = Path(path) / tag
    ckpt = _checkpointer(root, keep=1)
    try:
        ckpt.save(0, _state(model, optimizer, user_content), forced=True)
    finally:
        ckpt.close()
    if topology.rank() == 0:
        tmp = Path(path) / f"{_NEWEST}.tmp"
        tmp.write_text(tag + "\n", encoding="utf-8")
        tmp.replace(Path(path) / _NEWEST)
    topology.barrier()
    del partial, num_kept_partial_checkpoints  # every DCP checkpoint is sharded and reshardable


def resume_from_checkpoint(
    path: str | os.PathLike,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    model: Any = None,
    optimizer: Any = None,
    **_kwargs: Any,
) -> Any:
    """Loads into the DistributedModel (and the optimizer given, when load_optimizer); returns the
    user_content saved with it. Call it after creating the model and optimizer."""
    from hpkit.compat.smp.model import current_model

    model = model or current_model()
    if model is None:
        bad_setting("resume_from_checkpoint: create smp.DistributedModel(model) before resuming")
    if tag is None:
        newest = Path(path) / _NEWEST
        if not newest.exists():
            bad_setting(f"resume_from_checkpoint: {newest} is missing; pass tag= or check path={path}")
        tag = newest.read_text(encoding="utf-8").strip()
    from hpkit.compat.smp.optimizer import current_optimizer

    opt = (optimizer or current_optimizer()) if load_optimizer else None
    state = _state(model, opt, None)
    ckpt = _checkpointer(Path(path) / tag, keep=1)
    try:
        loaded, _ = ckpt.restore(state)
    finally:
        ckpt.close()
    if loaded is None:
        bad_setting(f"resume_from_checkpoint: no complete checkpoint under {Path(path) / tag}")
    del partial, strict
    dist.barrier()
    content = state["user_content"]
    content.seek(0)
    return pickle.loads(content.read())
