"""SMP v2's older checkpoint helpers (`torch.sagemaker.distributed.fsdp.checkpoint`), which scripts written
before the `distributed.checkpoint` API still call: on the same DCP save and load, commit record included."""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.distributed.fsdp.api import StateDictType

from hpkit.compat.smp_v2 import checkpoint
from hpkit.compat.smp_v2.fsdp import FullyShardedDataParallel

EXPORT_KEY_MODEL = "model"
EXPORT_KEY_OPTIMIZER = "optimizer"
EXPORT_KEY_SCHEDULER = "scheduler"
EXPORT_KEY_IDENTITY = "identity"


def _state(model: nn.Module, optimizer: Any, scheduler: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    state: dict[str, Any] = {EXPORT_KEY_MODEL: model.state_dict()}
    if optimizer is not None:
        state[EXPORT_KEY_OPTIMIZER] = FullyShardedDataParallel.optim_state_dict(model, optimizer)
    if scheduler is not None:
        state[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
    if extra:
        state[EXPORT_KEY_IDENTITY] = dict(extra)
    return state


def _pg(pg_metadata: Any) -> tuple[Any, int]:
    if not pg_metadata:
        return None, 0
    process_group, coordinator_rank, *_ = pg_metadata
    return process_group, int(coordinator_rank)


def save_model_checkpoint(
    model: nn.Module,
    state_dict_type: StateDictType,
    path: str | os.PathLike,
    sharding_strategy: Any = None,
    pg_metadata: Any = None,
    log: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    extra_exports: dict[str, Any] | None = None,
    **_ignored: Any,
) -> None:
    process_group, coordinator = _pg(pg_metadata)
    with FullyShardedDataParallel.state_dict_type(model, state_dict_type):
        state = _state(model, optimizer, scheduler, extra_exports)
        checkpoint.save(state, checkpoint_id=path, process_group=process_group, coordinator_rank=coordinator)


def load_model_checkpoint(
    model: nn.Module,
    state_dict_type: StateDictType,
    path: str | os.PathLike,
    sharding_strategy: Any = None,
    pg_metadata: Any = None,
    log: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    extra_imports: dict[str, Any] | None = None,
    **_ignored: Any,
) -> dict[str, Any]:
    """Loads into model, optimizer and scheduler; returns them and the extra values under the EXPORT_KEY_*s."""
    process_group, coordinator = _pg(pg_metadata)
    with FullyShardedDataParallel.state_dict_type(model, state_dict_type):
        state = _state(model, optimizer, scheduler, extra_imports)
        checkpoint.load(state, checkpoint_id=path, process_group=process_group, coordinator_rank=coordinator)
        model.load_state_dict(state[EXPORT_KEY_MODEL])
        if optimizer is not None:
            FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, state[EXPORT_KEY_OPTIMIZER])
    if scheduler is not None:
        scheduler.load_state_dict(state[EXPORT_KEY_SCHEDULER])
    return {
        EXPORT_KEY_MODEL: model,
        EXPORT_KEY_OPTIMIZER: optimizer,
        EXPORT_KEY_SCHEDULER: scheduler,
        EXPORT_KEY_IDENTITY: state.get(EXPORT_KEY_IDENTITY, {}),
    }
