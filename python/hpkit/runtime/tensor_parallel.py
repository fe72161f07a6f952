"""Tensor parallel (Megatron-style) plans for the reference decoder.

Whole model: attention and MLP are column- then row-parallel. With sequence parallel the norms and
the residual stream run sharded along the sequence between blocks, as torchtitan does: each row-parallel
output is reduce-scattered and each block input all-gathered, which moves the bytes of one all-reduce
and keeps 1/tp of the activations. Without it (the default on CPU, see `sequence_parallel_default`)
the residual stream stays whole and each row-parallel output is all-reduced.

Chosen modules only (SMP's set_tensor_parallelism on some modules): the chosen attention/MLP units
are column/row parallel and hand back ordinary replicated tensors, so they can sit next to modules
that are not parallelised; no sequence parallel then, because the residual stream stays whole.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from hpkit.errors import SpecError


def check_tp_shape(
    model: nn.Module, tp: int, seq_len: int, whole_model: bool, sequence_parallel: bool = True
) -> None:
    cfg = model.cfg
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"n_heads={cfg.n_heads}")
    if cfg.n_kv_heads % tp:
        problems.append(f"n_kv_heads={cfg.n_kv_heads}")
    if cfg.ffn_dim % tp:
        problems.append(f"ffn_dim={cfg.ffn_dim}")
    if whole_model and sequence_parallel and seq_len % tp:
        problems.append(f"seq_len={seq_len} (sequence parallel splits it)")
    if whole_model and cfg.vocab_size % tp:
        problems.append(f"vocab_size={cfg.vocab_size}")
    if problems:
        raise SpecError(f"parallelism.tp={tp} must divide {', '.join(problems)}")


def tp_units(model: nn.Module) -> list[str]:
    """The names tp_modules patterns are matched against."""
    units = [n for n in ("tok_embeddings", "output") if getattr(model, n, None) is not None]
    for idx in model.layers:
        units += [f"layers.{idx}.attention", f"layers.{idx}.feed_forward"]
    return units


def select_units(units: list[str], patterns: list[str]) -> list[str]:
    """A pattern names a unit, a prefix of units (`layers.0`), or a glob; a bare name (`attention`)
    matches that unit in every block."""

    def matches(unit: str, pattern: str) -> bool:
        return (
            fnmatch.fnmatchcase(unit, pattern)
            or fnmatch.fnmatchcase(unit, f"*.{pattern}")
            or unit.startswith(pattern.rstrip(".") + ".")
        )

    chosen = [u for u in units if any(matches(u, p) for p in patterns)]
    return chosen


def sequence_parallel_default(device_type: str) -> bool:
    """On for CUDA: NCCL's reduce-scatter plus all-gather cost what its all-reduce does, and the
    activations between blocks shrink by tp. Off for CPU: gloo runs a reduce-scatter as a full
    all-reduce, so sequence parallel would add an all-gather per block input and save nothing
    (26 all-gathers per step of the debug model under dp2 x tp2, about a third of its collective time)."""
    return device_type == "cuda"


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    modules: list[str] | None = None,
    loss_parallel: bool = False,
    sequence_parallel: bool = True,
) -> list[str]:
    """Parallelise in place; returns the units that were parallelised.

    With `loss_parallel` (whole model only) the output head hands back logits sharded along the
    vocabulary as a DTensor, for a loss computed under `torch.distributed.tensor.parallel.loss_parallel()`:
    no rank gathers the full (batch, seq, vocab) logits, which is the largest activation of a small
    model, and the backward needs no gather either.
    """
    if modules is None:
        _apply_whole_model(model, tp_mesh, loss_parallel, sequence_parallel)
        return tp_units(model)
    units = tp_units(model)
    chosen = select_units(units, modules)
    if not chosen:
        raise SpecError(
            f"parallelism.tp_modules {modules} matches no module; units are e.g. {', '.join(units[:4])}, "
            "'attention', 'feed_forward', 'layers.0'"
        )
    plan: dict[str, object] = {}
    for unit in chosen:
        leaf = unit.rsplit(".", 1)[-1]
        if leaf == "attention":
            plan |= {f"{unit}.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
            plan[f"{unit}.wo"] = RowwiseParallel()
        elif leaf == "feed_forward":
            plan |= {f"{unit}.w1": ColwiseParallel(), f"{unit}.w3": ColwiseParallel()}
            plan[f"{unit}.w2"] = RowwiseParallel()
        elif unit == "tok_embeddings":
            plan[unit] = RowwiseParallel(input_layouts=Replicate())
        elif unit == "output":
            plan[unit] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    return chosen


def _apply_whole_model(
    model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool
) -> None:
    # The residual stream between blocks is sequence-sharded under sequence parallel, else a plain tensor,
    # whole and equal on every TP rank. A pipeline stage may lack embeddings or the head, so stage
    # boundaries carry the same layout. Each block's attention and MLP turn their input into one DTensor
    # that the column-parallel projections share, so the backward sums their partial input gradients once.
    stream = Shard(1) if sequence_parallel else Replicate()

    def norm() -> ParallelStyle:
        return SequenceParallel() if sequence_parallel else ReplicateParallel()

    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None:
        top["norm"] = norm()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": norm(),
                "attention": PrepareModuleInput(
                    input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=stream),
                "ffn_norm": norm(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(stream,), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=stream),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


class ReplicateParallel(ParallelStyle):
    """A module that every tensor-parallel rank runs whole (the norms without sequence parallel).

    Its parameters become Replicate DTensors on the mesh, so that every parameter of the model lives on
    one mesh (FSDP, the fused optimizer and the grad norm treat them alike); its input and output stay
    plain tensors, identical on every rank, so its backward needs no collective.
    """

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in module.named_parameters(recurse=False):
            # The model is built on the meta device and initialised afterwards: no values to broadcast.
            replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(replicated, param.requires_grad))

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) else t
            for t in inputs
        )

    @staticmethod
    def _output_fn(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._input_fn, self._output_fn)
