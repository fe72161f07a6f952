"""SMP v2's `DelayedParamIniter`: a model built on the meta device (accelerate's init_empty_weights) is
materialised module by module inside FSDP's constructor, as FSDP1's `param_init_fn` does, so a rank never
holds more than one unsharded module beside its shards.

Each module is given real storage and initialised by the model's own Hugging Face `_init_weights`. Every rank
draws the same values (scripts seed every rank alike), so tensor-parallel shards, cut from those values,
match what a model built directly would hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hpkit.compat.smp_v2.state import bad_config, require


class DelayedParamIniter:
    def __init__(
        self, model: nn.Module, init_method_using_config: Callable | None = None, **_: object
    ) -> None:
        self.model = model
        self._init_weights = init_method_using_config or getattr(model, "_init_weights", None)
        self.device = require().device

    def _materialise(self, module: nn.Module) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if isinstance(param, DTensor):
                full = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                value = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            else:
                value = torch.empty_like(param, device=self.device)
            module.register_parameter(name, nn.Parameter(value, param.requires_grad))
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=self.device)
        if self._init_weights is not None:
            with torch.no_grad():
                self._init_weights(module)

    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        return self._materialise

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        def post(module: nn.Module) -> None:
            tie = getattr(module, "tie_weights", None)
            if callable(tie):
                tie()

        return post

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        yield
        if enabled:
            left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
            if left:
                raise bad_config(f"{left[0]} is still on the meta device after FSDP: pass param_init_fn")
