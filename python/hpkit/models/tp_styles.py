"""Tensor-parallel pieces that every model family's plan may use (hpkit.models.<family>.adapter): a style for
modules each rank runs whole, and the matching of `parallelism.tp_modules` patterns against unit names."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel.style import ParallelStyle


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
