"""Tensor parallel: the model family's plan (hpkit.models.adapters) applied to the whole model or to the
units `parallelism.tp_modules` chooses, and when sequence parallel is on by default.

The plans themselves (which projections are column- or row-parallel, how the residual stream is laid out
between blocks) belong to each family: Llama's is in hpkit.models.llama.adapter.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpkit.errors import SpecError
from hpkit.models.adapters import ModelAdapter, adapter_of
from hpkit.models.tp_styles import ReplicateParallel, select_units

__all__ = [
    "ReplicateParallel",
    "apply_tp",
    "check_tp_shape",
    "select_units",
    "sequence_parallel_default",
    "tp_units",
]


def check_tp_shape(
    model: nn.Module,
    tp: int,
    seq_len: int,
    whole_model: bool,
    sequence_parallel: bool = True,
    adapter: ModelAdapter | None = None,
) -> None:
    (adapter or adapter_of(model)).check_tp(model, tp, seq_len, whole_model, sequence_parallel)


def tp_units(model: nn.Module, adapter: ModelAdapter | None = None) -> list[str]:
    """The names tp_modules patterns are matched against."""
    return (adapter or adapter_of(model)).tp_units(model)


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
    adapter: ModelAdapter | None = None,
) -> list[str]:
    """Parallelise in place; returns the units that were parallelised.

    With `loss_parallel` (whole model only) the output head hands back logits sharded along the
    vocabulary as a DTensor, for a loss computed under `torch.distributed.tensor.parallel.loss_parallel()`:
    no rank gathers the full (batch, seq, vocab) logits, which is the largest activation of a small
    model, and the backward needs no gather either.
    """
    adapter = adapter or adapter_of(model)
    units = adapter.tp_units(model)
    if modules is None:
        adapter.apply_tp(model, tp_mesh, None, loss_parallel, sequence_parallel)
        return units
    chosen = select_units(units, modules)
    if not chosen:
        raise SpecError(
            f"parallelism.tp_modules {modules} matches no module; units are e.g. {', '.join(units[:4])}, "
            "'attention', 'feed_forward', 'layers.0'"
        )
    adapter.apply_tp(model, tp_mesh, chosen, False, False)
    return chosen
