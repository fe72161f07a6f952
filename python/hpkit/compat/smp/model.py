"""smp.DistributedModel: the user's model split into this rank's pipeline stage, its marked layers made
tensor parallel on the tp mesh, and the result replicated over the data-parallel ranks.

Order as in hpkit's runtime: PP splits first, then TP, then data parallel (FSDP2 as HSDP with shard
degree 1 when TP or PP is on, since DDP cannot hold DTensors; DDP otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hpkit.compat.smp import step_state, topology
from hpkit.compat.smp.tp_marking import is_marked
from hpkit.compat.smp.unsupported import stop

# Functions that act elementwise: a Linear -> (these) -> Linear chain can stay sharded in between.
_ELEMENTWISE = {
    F.relu,
    F.gelu,
    F.silu,
    F.tanh,
    F.sigmoid,
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    operator.mul,
}
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid"}
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid)

_current: DistributedModel | None = None


def current_model() -> DistributedModel | None:
    return _current


def tp_plan(module: nn.Module, graph: fx.GraphModule | None) -> dict[str, Any]:
    """A plan that is right wherever the marked layers sit: each marked layer is column parallel and
    hands back a whole (replicated) output, except that a marked Linear whose output reaches exactly one
    marked Linear through elementwise steps only is column parallel into a row-parallel partner, so the
    activation in between stays sharded (one all-reduce instead of an all-gather each)."""
    marked = {name for name, sub in module.named_modules() if name and is_marked(sub)}
    plan: dict[str, Any] = {}
    if graph is not None:
        for first, second in _linear_pairs(graph, module, marked):
            if first in plan or second in plan:
                continue
            plan[first] = ColwiseParallel()
            plan[second] = RowwiseParallel()
    for name in sorted(marked - set(plan)):
        plan[name] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _linear_pairs(graph: fx.GraphModule, module: nn.Module, marked: set[str]) -> Iterator[tuple[str, str]]:
    def is_linear(node: fx.Node) -> bool:
        return (
            node.op == "call_module"
            and node.target in marked
            and isinstance(module.get_submodule(node.target), nn.Linear)
        )

    def elementwise(node: fx.Node) -> bool:
        if node.op == "call_function":
            return node.target in _ELEMENTWISE and len(node.all_input_nodes) == 1
        if node.op == "call_method":
            return node.target in _ELEMENTWISE_METHODS
        if node.op == "call_module":
            return isinstance(module.get_submodule(node.target), _ELEMENTWISE_MODULES)
        return False

    used: dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op == "call_module":
            used[node.target] = used.get(node.target, 0) + 1
    for node in graph.graph.nodes:
        if not is_linear(node) or used[node.target] != 1:
            continue
        cur = node
        while len(cur.users) == 1:
            (nxt,) = cur.users
            if is_linear(nxt) and used[nxt.target] == 1:
                yield node.target, nxt.target
                break
            if not elementwise(nxt):
                break
            cur = nxt


def gather_stages(local: dict[str, Any]) -> dict[str, Any]:
    """Every pipeline stage's entries (keyed by the original names), merged on every rank of the stage group."""
    group = topology.get_pp_process_group()
    if group is None:
        return local
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def _forward_in_bf16(module: nn.Module, device: torch.device) -> None:
    """SMP's bf16: the model computes in bfloat16. Under autocast the parameters stay fp32 (the optimizer's
    master weights) and matmuls run in bf16; every path through the model (forward, the DDP/FSDP wrapper,
    the pipeline schedule) calls this module, so all of them get it."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return inner(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


class DistributedModel(nn.Module):
    """Holds this rank's part of the model as `module` (DDP- or FSDP-wrapped where replicated)."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        global _current
        super().__init__()
        if args or kwargs:
            stop(
                f"smp.DistributedModel({', '.join([*(['...'] * len(args)), *kwargs])})",
                "pass the model alone: the split is balanced by parameter count, gradients are averaged",
            )
        if _current is not None:
            stop("a second smp.DistributedModel", "wrap one model per process, as SMP requires")
        st = topology.state()
        cfg, coords = st.config, st.coords
        self.device = st.device
        self.original = [module]  # kept out of the module tree: its parameters are the stage's, or not here
        graph: fx.GraphModule | None
        if cfg.pp > 1:
            from hpkit.compat.smp.partition import partition

            parts = partition(module, cfg.pp)
            # Only this stage's layers move to the device (the stage holds the model's own submodules).
            local: nn.Module = parts.stages[coords.pp_rank].to(self.device)
            graph = parts.stages[coords.pp_rank]
        else:
            local = module.to(self.device)
            graph = _try_trace(module) if cfg.tp > 1 else None
        plan = tp_plan(local, graph) if cfg.tp > 1 else {}
        if plan:
            parallelize_module(local, coords.tp_mesh, plan)
        # What each marked layer became, for logs and tests.
        self.tp_plan = {name: type(style).__name__ for name, style in plan.items()}
        if cfg.bf16:
            _forward_in_bf16(local, self.device)
        self._replicate_init(local)
        self._fsdp = coords.fsdp_mesh is not None
        self._ddp = coords.ddp_mesh is not None
        if self._fsdp:
            from torch.distributed.fsdp import fully_shard

            # Under PP each microbatch runs forward and backward separately: keep weights gathered.
            fully_shard(local, mesh=coords.fsdp_mesh, reshard_after_forward=False)
            self.module = local
        elif self._ddp:
            from hpkit.runtime.parallel.fsdp import apply_ddp

            self.module = apply_ddp(local, coords.ddp_mesh, self.device)
        else:
            self.module = local
        self.local_module = local
        self.schedule = None
        if cfg.pp > 1:
            self.schedule = step_state.build_schedule(
                local, coords, self.device, cfg.microbatches, cfg.schedule
            )
        _current = self

    def _replicate_init(self, local: nn.Module) -> None:
        """Replicas start from dp rank 0's weights, as DDP does, also when the script did not seed."""
        group = topology.get_dp_process_group()
        if group is None:
            return
        with torch.no_grad():
            for tensor in [*local.parameters(), *local.buffers()]:
                data = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                dist.broadcast(data, group=group, group_src=0)

    # ----------------------------------------------------------------------------------------------
    # forward and backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.schedule is not None:
            stop(
                "calling the model outside an @smp.step function with pipeline_parallel_degree > 1",
                "put the forward pass and model.backward(loss) in a function decorated with @smp.step",
            )
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not step_state.backward_in_step(loss):
            loss.backward(*args, **kwargs)

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Gradients are averaged over replicas only on the step's last microbatch."""
        if self._fsdp:
            self.module.set_requires_gradient_sync(enabled)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        elif self._ddp and not enabled:
            with self.module.no_sync():
                yield
        else:
            yield

    # ----------------------------------------------------------------------------------------------
    # state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The whole model's state under the original names, on every rank (gathered across stages)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local = get_model_state_dict(self.local_module, options=StateDictOptions(full_state_dict=True))
        local = {k: v.detach().cpu() for k, v in local.items()}
        return gather_stages(local)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own shard of its stage: plain tensors, keys as in the original model."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {
            k: v.to_local() if isinstance(v, DTensor) else v
            for k, v in get_model_state_dict(self.local_module).items()
        }

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, **_kwargs: Any) -> Any:
        """Takes a whole-model state dict (from state_dict() or a single-process model)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        own = set(self.local_module.state_dict())
        if strict:
            missing = sorted(own - set(state_dict))
            if missing:
                raise KeyError(f"smp: load_state_dict: missing keys {missing[:5]}")
        mine = {k: v for k, v in state_dict.items() if k in own}
        return set_model_state_dict(
            self.local_module, mine, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    @property
    def partitioned(self) -> bool:
        return True


def _try_trace(module: nn.Module) -> fx.GraphModule | None:
    try:
        return fx.symbolic_trace(module)
    except Exception:  # an untraceable forward only loses the Linear->Linear pairing
        return None
