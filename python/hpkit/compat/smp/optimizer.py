"""smp.DistributedOptimizer: the user's optimizer over this rank's parameters, with state dicts keyed by
the original model's parameter names (gathered across pipeline stages), as DistributedModel's are."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpkit.compat.smp import topology
from hpkit.compat.smp.unsupported import bad_setting

_current: DistributedOptimizer | None = None


def current_optimizer() -> DistributedOptimizer | None:
    return _current


class DistributedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            from hpkit.compat.smp.unsupported import stop

            stop(
                f"smp.DistributedOptimizer({', '.join(kwargs) or '...'})",
                "pass the optimizer alone (static/dynamic loss scaling is fp16's, use bf16 instead)",
            )
        global _current
        self.optimizer = optimizer
        _current = self

    def _model(self) -> Any:
        from hpkit.compat.smp.model import current_model

        model = current_model()
        if model is None:
            bad_setting("smp.DistributedOptimizer needs smp.DistributedModel(model) created first")
        return model

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optimizer.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def local_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The whole model's optimizer state, keyed by parameter name, on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model = self._model()
        local = get_optimizer_state_dict(
            model.local_module,
            self.optimizer,
            options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
        )
        local = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in local.items()}
        group = topology.get_pp_process_group()
        if group is None:
            return local
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        model = self._model()
        own = set(model.local_module.state_dict())
        mine = {k: v for k, v in state_dict.items() if _owned(k, own)}
        set_optimizer_state_dict(
            model.local_module,
            self.optimizer,
            mine,
            options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _owned(key: str, own: set[str]) -> bool:
    # Flattened keys read "state.<param name>.<state name>" or "param_groups.<param name>.<option>".
    _, _, rest = key.partition(".")
    name, _, _ = rest.rpartition(".")
    return name in own
