"""What the runtime asks of a model family (as torchtitan's TrainSpec): one adapter per family.

The runtime's parallelisms are written against this interface, never against a model's attributes:
pipeline splitting asks which blocks and edges a stage keeps, activation checkpointing, compile and FSDP
wrap `blocks`, FSDP makes `input_units`/`output_units` units of their own, tensor parallel takes the
family's plan, and the trainer builds, initialises, counts FLOPs and loads Hugging Face weights through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class HfModel:
    """A Hugging Face model as the runtime sees it: its shape, tying, and the fields passed through."""

    cfg: Any  # the family's model config (hpkit.models.llama.model.LlamaConfig for Llama and its MoE)
    tied: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HfMapping:
    """A model family's Hugging Face format: its config.json both ways, and the tensor names between them.
    A family's adapter (ModelAdapter.hf) names its mapping: Llama's is hpkit.models.llama.hf_format.LLAMA."""

    read_config: Callable[[str | Path, int], HfModel]  # (directory, seq_len) -> shape, tying, extras
    tensor_name: Callable[[str], str]  # hpkit parameter name -> Hugging Face tensor name
    rotary_heads: Callable[[str, Any], int | None]  # heads whose rows change rotary layout, or None
    to_config: Callable[[Any, dict[str, Any], str], dict[str, Any]]  # (cfg, extras, dtype) -> config.json
    # Weights the runtime holds as one [E, ...] tensor and Hugging Face as one tensor per expert:
    # (hpkit parameter name, expert j) -> that expert's tensor name, or None for every other parameter.
    expert_tensor: Callable[[str, int], str | None] | None = None


class ModelAdapter(ABC):
    """One model family. Subclasses implement every abstract method; `family` is its name in
    hpkit.models.families."""

    family: str = ""
    # The family's Hugging Face format (model.init_from, `hpkit ckpt export --hf`); None: it has none.
    hf: HfMapping | None = None

    # ---- configuration ---------------------------------------------------------------------------

    @abstractmethod
    def config(self, shape: Any) -> Any:
        """The model's configuration from the spec's model block resolved to the family's torch-free shape
        (`ModelSpec.named_shape()`: a named shape and its overrides, hpkit.models.llama.shape.ModelShape for
        Llama); SpecError naming the field when it does not make a model."""
        raise NotImplementedError

    @abstractmethod
    def config_to_dict(self, cfg: Any) -> dict[str, Any]:
        """Plain JSON for the checkpoint's commit record (read back torch-free by `hpkit ckpt export`)."""
        raise NotImplementedError

    @abstractmethod
    def config_from_dict(self, data: dict[str, Any]) -> Any:
        raise NotImplementedError

    @abstractmethod
    def num_params(self, cfg: Any) -> int:
        raise NotImplementedError

    @abstractmethod
    def flops_per_token(self, cfg: Any, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) of the weights a token actually passes through."""
        raise NotImplementedError

    # ---- the module ------------------------------------------------------------------------------

    @abstractmethod
    def build(self, cfg: Any, device: torch.device | str = "meta") -> nn.Module:
        raise NotImplementedError

    @abstractmethod
    def owns(self, model: nn.Module) -> bool:
        """Whether `model` (whole or a pipeline stage) is one of this family's."""
        raise NotImplementedError

    @abstractmethod
    def init_weights(self, model: nn.Module, seed: int) -> None:
        """Initialise every parameter from (seed, its name), whatever the model's split or sharding."""
        raise NotImplementedError

    @abstractmethod
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        """The repeated blocks, keyed by their index in the whole model: what activation checkpointing,
        compile and FSDP wrap one by one (a wrapper is put back under the same key)."""
        raise NotImplementedError

    @abstractmethod
    def input_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules before the first block (the embeddings) that this part still holds."""
        raise NotImplementedError

    @abstractmethod
    def output_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules after the last block (final norm, output head) that this part still holds."""
        raise NotImplementedError

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """The routed experts' modules (expert parallel shards them; FSDP makes them units of their own)."""
        return []

    # ---- pipeline parallel -------------------------------------------------------------------------

    @abstractmethod
    def keep_stage(self, part: nn.Module, blocks: list[int], first: bool, last: bool) -> nn.Module:
        """Cut a (meta-device) copy of the whole model down to one stage: only `blocks`, the input units
        when `first`, the output units when `last`; kept modules keep their names, so checkpoints are keyed
        alike in every layout. A stage without input units takes hidden states, one without output units
        returns them."""
        raise NotImplementedError

    # ---- tensor parallel ---------------------------------------------------------------------------

    @abstractmethod
    def tp_units(self, model: nn.Module) -> list[str]:
        """The unit names `parallelism.tp_modules` patterns are matched against."""
        raise NotImplementedError

    @abstractmethod
    def check_tp(
        self, model: nn.Module, tp: int, seq_len: int, whole_model: bool, sequence_parallel: bool
    ) -> None:
        """SpecError naming every dimension that tp does not divide."""
        raise NotImplementedError

    @abstractmethod
    def apply_tp(
        self,
        model: nn.Module,
        tp_mesh: DeviceMesh,
        units: list[str] | None,
        loss_parallel: bool,
        sequence_parallel: bool,
    ) -> None:
        """Parallelise in place: the whole model (units None) or the chosen units only (no sequence
        parallel then: their inputs and outputs are whole tensors)."""
        raise NotImplementedError
