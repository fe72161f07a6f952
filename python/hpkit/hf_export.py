"""`hpkit ckpt export --hf`: a DCP checkpoint of any layout -> config.json + sharded safetensors.

Offline and in one process: DCP reassembles each full tensor from whichever ranks' files hold its
shards (no process group is needed), a few tensors at a time, so memory stays near one output shard.
The model's shape comes from the checkpoint's commit record (the runtime writes it there), and every
file is checked against the record's CRC-32C before anything is read.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpkit.errors import HpkitError, SpecError
from hpkit.hf.config import HfMapping
from hpkit.hf.load import INDEX_NAME, to_hf_rows
from hpkit.runtime.adapters import ADAPTERS, ModelAdapter
from hpkit.runtime.checkpoint_record import RECORD_NAME, RecordError, read_record, verify_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_PREFIX = "model."  # the runtime saves the model's state under this key (Trainer.checkpoint_state)


@dataclass(frozen=True)
class ExportResult:
    step_dir: Path
    out: Path
    files: list[str]
    tensors: int
    total_bytes: int
    dtype: str


def find_step_dir(source: Path) -> Path:
    """SOURCE itself when it is one checkpoint, else the newest committed one under it."""
    if (source / RECORD_NAME).is_file():
        return source
    from hpkit.runtime.checkpoint import find_latest

    found = find_latest(source) if source.is_dir() else None
    if found is None:
        raise HpkitError(f"{source}: no committed checkpoint here (no step-N directory with {RECORD_NAME})")
    return found


def export_hf(
    source: Path, out: Path, dtype: str = "auto", shard_bytes: int = 5 * 2**30, verify: bool = True
) -> ExportResult:
    step_dir = find_step_dir(source)
    try:
        record = read_record(step_dir)
    except RecordError as exc:
        raise HpkitError(f"{step_dir}: {exc}") from None
    if verify:
        problems = verify_files(step_dir, record)
        if problems:
            raise HpkitError(f"{step_dir}: {problems[0]}: export another checkpoint (hpkit ckpt ls)")
    if not record.model or "config" not in record.model:
        raise HpkitError(
            f"{step_dir}: its {RECORD_NAME} has no model config (saved by an hpkit that did not record it): "
            "resume the run for one step with this hpkit to save a checkpoint that has it"
        )
    # Records written before model families existed hold Llama models.
    family = record.model.get("family", "llama")
    adapter = ADAPTERS.get(family)
    if adapter is None or adapter.hf is None:
        raise HpkitError(f"{step_dir}: a {family} model: hpkit has no Hugging Face format for that family")
    cfg = adapter.config_from_dict(record.model["config"])
    extras = dict(record.model.get("hf") or {})
    try:
        adapter.hf.to_config(
            cfg, extras, "float32"
        )  # refuses a model the format cannot hold, before any work
    except SpecError as exc:
        raise HpkitError(f"{step_dir}: {exc}") from None
    if out.exists() and any(out.iterdir()):
        raise HpkitError(f"{out}: not empty: export into a new directory")

    stored = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    names = _parameter_shapes(adapter, cfg)
    for name, shape in names.items():
        meta = stored.get(_MODEL_PREFIX + name)
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != shape:
            found = list(meta.size) if isinstance(meta, TensorStorageMetadata) else "nothing"
            raise HpkitError(
                f"{step_dir}: {_MODEL_PREFIX + name}: the record's model config implies {list(shape)}, "
                f"the checkpoint has {found}"
            )
    first = stored[_MODEL_PREFIX + next(iter(names))]
    out_dtype = first.properties.dtype if dtype == "auto" else DTYPES[dtype]
    dtype_name = next(k for k, v in DTYPES.items() if v == out_dtype)

    groups = _shards(names, out_dtype.itemsize, shard_bytes)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map, files, total = {}, [], 0
        for i, group in enumerate(groups, 1):
            file = (
                "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            )
            tensors = _read_group(step_dir, stored, group, cfg, adapter.hf, out_dtype)
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            for key, value in tensors.items():
                weight_map[key] = file
                total += value.numel() * value.element_size()
            files.append(file)
        if len(groups) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        hf_config = adapter.hf.to_config(cfg, extras, dtype_name)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(step_dir, out, files, len(weight_map), total, dtype_name)


def _parameter_shapes(adapter: ModelAdapter, cfg: Any) -> dict[str, tuple[int, ...]]:
    # The meta-device model names every parameter a checkpoint of this shape holds, in model order.
    return {name: tuple(p.shape) for name, p in adapter.build(cfg, "meta").named_parameters()}


def _shards(names: dict[str, tuple[int, ...]], itemsize: int, limit: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in names.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _read_group(
    step_dir: Path,
    stored: dict[str, Any],
    group: list[str],
    cfg: Any,
    mapping: HfMapping,
    out_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    state = {
        _MODEL_PREFIX + n: torch.empty(
            stored[_MODEL_PREFIX + n].size, dtype=stored[_MODEL_PREFIX + n].properties.dtype
        )
        for n in group
    }
    with warnings.catch_warnings():
        # One process without a process group is exactly what an offline export means.
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    tensors = {}
    for name in group:
        value = state[_MODEL_PREFIX + name]
        if mapping.expert_tensor is not None and mapping.expert_tensor(name, 0) is not None:
            # One [E, ...] tensor here, one tensor per expert in the format.
            for j, expert in enumerate(value):
                tensors[mapping.expert_tensor(name, j)] = expert.to(out_dtype).contiguous()
            continue
        heads = mapping.rotary_heads(name, cfg)
        if heads is not None:
            value = to_hf_rows(value, heads)
        tensors[mapping.tensor_name(name)] = value.to(out_dtype).contiguous()
    return tensors
