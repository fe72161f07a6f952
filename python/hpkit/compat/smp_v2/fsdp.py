"""The script's `FullyShardedDataParallel(...)`, as SMP v2 scripts write it (FSDP1's constructor and
surface), built on FSDP2 (`fully_shard`) over the mesh `tsm.init` made.

torch 2.13's FSDP1 refuses CPU and cannot hold the DTensor shards that tensor parallel leaves, so under the shim
`torch.distributed.fsdp.FullyShardedDataParallel` is this class (hpkit.compat.smp_v2.install). The model it
returns is the script's own module, sharded in place: its class gains FSDP2's and this one's methods, so
`isinstance(model, FSDP)`, `model.clip_grad_norm_`, `FSDP.state_dict_type(model, ...)`, `no_sync` and
`process_group` work as the script expects. The wrap policy picks the FSDP units exactly as FSDP1 would
(each policy is asked about each module, children first); the root is a unit last.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.api import ShardingStrategy, StateDictType
from torch.distributed.tensor import DTensor

from hpkit.compat.smp_v2.state import bad_config, require
from hpkit.runtime.loop.grad_norm import clip_grads_, total_grad_norm

_state_dict_type: contextvars.ContextVar[StateDictType | None] = contextvars.ContextVar(
    "hpkit_tsm_state_dict_type", default=None
)
_full_options: contextvars.ContextVar[StateDictOptions | None] = contextvars.ContextVar(
    "hpkit_tsm_state_dict_options", default=None
)

# FSDP1 arguments that FSDP2 makes moot: it always keeps the original parameters, prefetches on its own
# and bounds its all-gathers itself.
_MOOT = ("use_orig_params", "limit_all_gathers", "forward_prefetch", "backward_prefetch", "device_id")


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    token = _state_dict_type.set(None)
    try:
        yield
    finally:
        _state_dict_type.reset(token)


def _mp_policy(mixed_precision: Any) -> MixedPrecisionPolicy:
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=getattr(mixed_precision, "param_dtype", None),
        reduce_dtype=getattr(mixed_precision, "reduce_dtype", None),
        cast_forward_inputs=getattr(mixed_precision, "cast_forward_inputs", True),
    )


def _mesh(strategy: ShardingStrategy | None) -> DeviceMesh:
    """The data-parallel mesh for the strategy: tsm.init's, unless the script's strategy asks for another
    split and nothing (tp, ep, hybrid_shard_degree) ties the layout down."""
    state = require()
    coords = state.coords
    free = coords.dims.tp == 1 and coords.dims.ep == 1 and not state.config.hybrid_shard_degree
    world = dist.get_world_size()
    if free and strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        # FSDP1's HYBRID_SHARD without a degree: shard within a node, replicate across nodes.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % local == 0 and local < world:
            return init_device_mesh(
                state.device.type, (world // local, local), mesh_dim_names=("rep", "shard")
            )
    if free and strategy == ShardingStrategy.NO_SHARD:
        return init_device_mesh(state.device.type, (world, 1), mesh_dim_names=("rep", "shard"))
    mesh = coords.fsdp_mesh
    if mesh is None:
        mesh = coords.sub("dp_replicate", "dp_shard") or coords.mesh
    return mesh


def _numel(module: nn.Module, wrapped: set[int]) -> int:
    total = 0
    for child in module.children():
        if id(child) not in wrapped:
            total += _numel(child, wrapped)
    return total + sum(p.numel() for p in module.parameters(recurse=False))


def _policy_picks(policy: Any, root: nn.Module) -> list[nn.Module]:
    """The modules FSDP1's auto-wrap would make units of, children before parents, the root excluded."""
    if policy is None:
        return []
    picked: list[nn.Module] = []
    wrapped: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is root:
            return
        numel = _numel(module, wrapped)
        if policy(module=module, recurse=False, nonwrapped_numel=numel):
            picked.append(module)
            wrapped.add(id(module))

    visit(root)
    return picked


def _materialise(module: nn.Module, param_init_fn: Any) -> None:
    """FSDP1's delayed init: each module that still has meta tensors is handed to param_init_fn."""
    if param_init_fn is None:
        return
    for sub in list(module.modules()):
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            param_init_fn(sub)
    left = [n for n, p in module.named_parameters() if p.is_meta]
    if left:
        raise bad_config(f"param_init_fn left {left[0]} (and {len(left) - 1} more) on the meta device")


def _sync_from_rank0(module: nn.Module) -> None:
    """sync_module_states: rank 0's plain parameters and buffers on every rank (TP shards came from rank 0)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if not isinstance(tensor, DTensor) and not tensor.is_meta:
            dist.broadcast(tensor.data, src=0)


class FullyShardedDataParallel(nn.Module):
    """FSDP1's constructor on FSDP2. Returns the script's module, sharded, with FSDP1's methods."""

    def __new__(
        cls,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Any = None,
        mixed_precision: Any = None,
        ignored_modules: Any = None,
        param_init_fn: Any = None,
        sync_module_states: bool = False,
        post_param_init_fn: Any = None,
        device_mesh: DeviceMesh | None = None,
        **kwargs: Any,
    ):
        state = require()
        unknown = sorted(k for k in kwargs if k not in _MOOT)
        if unknown:
            raise bad_config(f"FullyShardedDataParallel({unknown[0]}=...) is not an FSDP argument: drop it")
        if process_group is not None and dist.get_rank() == 0:
            print(
                "tsm: warning: FSDP process_group is ignored: the mesh comes from tsm.init", file=sys.stderr
            )
        _materialise(module, param_init_fn)
        if post_param_init_fn is not None:
            post_param_init_fn(module)
        if sync_module_states:
            _sync_from_rank0(module)
        mesh = device_mesh if device_mesh is not None else _mesh(sharding_strategy)
        reshard = sharding_strategy not in (
            ShardingStrategy.SHARD_GRAD_OP,
            ShardingStrategy._HYBRID_SHARD_ZERO2,
        )
        options: dict[str, Any] = {"mp_policy": _mp_policy(mixed_precision), "reshard_after_forward": reshard}
        if getattr(cpu_offload, "offload_params", False) and state.device.type == "cuda":
            options["offload_policy"] = CPUOffloadPolicy()
        ignored: set[nn.Parameter] = set()
        for ignored_module in ignored_modules or ():
            ignored.update(ignored_module.parameters())
        if ignored:
            options["ignored_params"] = ignored
        # Experts split over the ep ranks are units of their own over the ranks that hold the same experts.
        for sub in module.modules():
            expert_mesh = getattr(sub, "_hpkit_expert_mesh", None)
            if expert_mesh is not None:
                fully_shard(sub, mesh=expert_mesh, **options)
        units = [u for u in _policy_picks(auto_wrap_policy, module) if not isinstance(u, FSDPModule)]
        for i, unit in enumerate(units):
            # The last unit's weights are needed again at once by backward: keep them gathered (as FSDP1's
            # root, and hpkit's own runtime, do), rather than free and all-gather them straight back.
            last = {"reshard_after_forward": False} if i == len(units) - 1 else {}
            fully_shard(unit, mesh=mesh, **{**options, **last})
        fully_shard(module, mesh=mesh, **options)
        module.__class__ = type(f"FullyShardedDataParallel[{type(module).__name__}]", (cls, type(module)), {})
        module._hpkit_fsdp_mesh = mesh
        return module

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # __new__ returned the script's module, already built: nothing to initialise again.
        pass

    # FSDP1's instance surface -------------------------------------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup:
        mesh: DeviceMesh = self._hpkit_fsdp_mesh
        return mesh.get_group(mesh.ndim - 1)

    @property
    def module(self) -> nn.Module:
        return self

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm(self, max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        kind = _state_dict_type.get()
        if kind == StateDictType.FULL_STATE_DICT:
            with _plain():  # torch's helper calls state_dict() itself
                return get_model_state_dict(self, options=_full_options.get())
        if kind == StateDictType.LOCAL_STATE_DICT:
            return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in super().state_dict().items()}
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if _state_dict_type.get() == StateDictType.FULL_STATE_DICT:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False, strict=strict)
            with _plain():
                return set_model_state_dict(self, state_dict, options=options)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # FSDP1's static surface ---------------------------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> Iterator[None]:
        full = state_dict_type == StateDictType.FULL_STATE_DICT
        options = StateDictOptions(
            full_state_dict=full, cpu_offload=bool(getattr(state_dict_config, "offload_to_cpu", False))
        )
        token = _state_dict_type.set(state_dict_type)
        token_options = _full_options.set(options)
        try:
            yield
        finally:
            _state_dict_type.reset(token)
            _full_options.reset(token_options)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False, **_: Any
    ) -> Iterator[None]:
        """Whole (data-parallel-gathered) parameters inside the block. Read-only here: FSDP2 gathers into
        separate buffers, so in-place writes inside the block are not copied back to the shards."""
        units = [m for m in module.modules() if isinstance(m, FSDPModule)] if recurse else [module]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> dict:
        full = _state_dict_type.get() == StateDictType.FULL_STATE_DICT
        with _plain():
            return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=full))

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict, *args: Any, **kwargs: Any
    ) -> dict:
        # FSDP1 returns a dict for optim.load_state_dict; here the state goes in at once and the optimizer's
        # own state dict is handed back, so the script's load_state_dict that follows changes nothing.
        full = _state_dict_type.get() == StateDictType.FULL_STATE_DICT
        with _plain():
            set_optimizer_state_dict(
                model, optim, optim_state_dict, options=StateDictOptions(full_state_dict=full)
            )
        return optim.state_dict()

    @staticmethod
    def clip_grad_norm(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm(module, max_norm, norm_type)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm over every mesh the parameters live on, and clipping by it."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = total_grad_norm(params, norm_type=norm_type)
    clip_grads_(params, max_norm, total)
    return total
