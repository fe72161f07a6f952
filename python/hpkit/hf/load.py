"""Load a Hugging Face Llama's safetensors into the runtime's model after it was parallelised.

Each rank reads only the part of each tensor that its shard of the parameter holds, on any layout
(FSDP, TP, PP and their products): the shard's box in the full tensor comes from the DTensor's
placements, computed as DCP computes it, and safetensors slices the memory-mapped file lazily, so
nothing else is read. The q and k projections are read by whole heads (at most one head more on each
side of the box): their rows are permuted within each head, because Hugging Face rotates the halves
of a head where the runtime rotates interleaved pairs.

Why not DCP's HuggingFaceStorageReader (torch has one): it would load each shard as stored, and an FSDP
shard boundary may fall inside a head, where the permutation needs rows that another rank holds. Reading
whole heads from the file costs a few rows; fixing them up afterwards would cost a collective per tensor.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from hpkit import json_text
from hpkit.errors import SpecError
from hpkit.models.llama.hf_format import LLAMA, HfMapping, HfModel
from hpkit.models.llama.model import LlamaConfig, named_parameters_unwrapped

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadStats:
    tensors: int
    bytes_read: int  # what this rank read from the files (its shards, plus whole q/k heads)


def tensor_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index when there is one, else every file's header."""
    root = Path(directory)
    index = root / INDEX_NAME
    where = f"model.init_from: {root}"
    if index.is_file():
        try:
            weight_map = json_text.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SpecError(f"{where}: {INDEX_NAME} is unreadable: {type(exc).__name__}: {exc}") from None
        return {name: root / file for name, file in weight_map.items()}
    found: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), file))
    if not found:
        raise SpecError(f"{where}: no *.safetensors files: init_from needs the weights beside config.json")
    return found


def to_runtime_rows(block: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of whole heads from Hugging Face's rotary layout (halves) to the runtime's (interleaved pairs)."""
    rows, rest = block.shape[0], block.shape[1:]
    return block.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def to_hf_rows(block: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of to_runtime_rows."""
    rows, rest = block.shape[0], block.shape[1:]
    return block.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def load_hf_weights(
    model: nn.Module, directory: str | Path, hf: HfModel, mapping: HfMapping = LLAMA
) -> LoadStats:
    """Overwrite every parameter of `model` (a whole model or a pipeline stage, plain or DTensor) with
    the checkpoint's values, named as the family's `mapping` says; SpecError names the tensor when the
    files do not fit the model."""
    root = Path(directory)
    files = tensor_files(root)
    tensors = read = 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for name, param in named_parameters_unwrapped(model):
            target = param.to_local() if isinstance(param, DTensor) else param
            offset = _global_offset(param)
            if mapping.expert_tensor is not None and mapping.expert_tensor(name, 0) is not None:
                # One hpkit tensor, one file tensor per expert: read only this rank's experts' boxes.
                if target.numel():
                    values = torch.stack(
                        [
                            _read_box(
                                _slice(
                                    files,
                                    handles,
                                    stack,
                                    root,
                                    mapping.expert_tensor(name, j),
                                    param.shape[1:],
                                ),
                                offset[1:],
                                tuple(target.shape[1:]),
                                None,
                                hf.cfg,
                            )
                            for j in range(offset[0], offset[0] + target.shape[0])
                        ]
                    )
                    read += values.numel() * values.element_size()
                    target.copy_(values)
                    tensors += 1
                continue
            source = mapping.tensor_name(name)
            if source not in files and name == "output.weight" and hf.tied:
                source = mapping.tensor_name(
                    "tok_embeddings.weight"
                )  # tied: the head is the embedding matrix
            part = _slice(files, handles, stack, root, source, param.shape)
            if target.numel() == 0:
                continue
            values = _read_box(part, offset, tuple(target.shape), mapping.rotary_heads(name, hf.cfg), hf.cfg)
            read += values.numel() * values.element_size()
            target.copy_(values)
            tensors += 1
    return LoadStats(tensors, read)


def _slice(
    files: dict[str, Path],
    handles: dict[Path, Any],
    stack: contextlib.ExitStack,
    root: Path,
    source: str,
    shape: Any,
) -> Any:
    """A lazy view of one file tensor, checked against the shape the config implies."""
    if source not in files:
        raise SpecError(f"model.init_from: {root}: no tensor {source} in its safetensors files")
    path = files[source]
    if path not in handles:
        handles[path] = stack.enter_context(safe_open(path, framework="pt"))
    part = handles[path].get_slice(source)
    if tuple(part.get_shape()) != tuple(shape):
        raise SpecError(
            f"model.init_from: {root}: {source} has shape {list(part.get_shape())}, config.json implies {list(shape)}"
        )
    return part


def _global_offset(param: torch.Tensor) -> tuple[int, ...]:
    if not isinstance(param, DTensor):
        return (0,) * param.dim()
    # DCP saves and loads shards by this same box (a shard under FSDP x TP is still one box).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if tuple(local_shape) != tuple(param.to_local().shape):
        raise RuntimeError(
            f"shard of shape {list(param.to_local().shape)} is not the box {list(local_shape)}"
        )
    return tuple(offset)


def _read_box(
    part: Any, offset: tuple[int, ...], shape: tuple[int, ...], heads: int | None, cfg: LlamaConfig
) -> torch.Tensor:
    box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    if heads is None:
        return part[box]
    head_dim = cfg.head_dim
    first = offset[0] // head_dim
    last = -(-(offset[0] + shape[0]) // head_dim)
    whole = part[(slice(first * head_dim, last * head_dim), *box[1:])]
    rows = to_runtime_rows(whole, last - first)
    start = offset[0] - first * head_dim
    return rows[start : start + shape[0]]
