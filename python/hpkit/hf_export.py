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
from hpkit.hf.load import INDEX_NAME, to_hf_rows
from hpkit.models.adapters import ADAPTERS, ModelAdapter
from hpkit.models.llama.hf_format import HfMapping
from hpkit.runtime.checkpoints.checkpoint_record import RECORD_NAME, RecordError, read_record, verify_files

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
    from hpkit.runtime.checkpoints.checkpoint import find_latest

    found = find_latest(source) if source.is_dir() else None
    if found is None:
        raise HpkitError(f"{source}: no committed checkpoint here (no step-N directory with {RECORD_NAME})")
    return found


def export_hf(
    source: Path,
    out: Path,
    dtype: str = "auto",
    shard_bytes: int = 5 * 2**30,
    verify: bool = True,
    merge: bool = False,
) -> ExportResult:
    """A whole-model checkpoint as config.json + safetensors; a LoRA checkpoint as a PEFT adapter, or with
    `merge` as the base with the adapters merged in (export_lora)."""
    step_dir = find_step_dir(source)
    record = _checked_record(step_dir, verify)
    adapter, cfg, extras = _exportable_model(step_dir, record)
    if out.exists() and any(out.iterdir()):
        raise HpkitError(f"{out}: not empty: export into a new directory")
    if record.model.get("lora"):
        return export_lora(step_dir, record.model, adapter, cfg, out, dtype, shard_bytes, merge)
    if merge:
        raise HpkitError(
            f"{step_dir}: --merge merges LoRA adapters, and this checkpoint holds a whole model: drop --merge"
        )
    stored = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    names = _checked_shapes(step_dir, stored, adapter, cfg)
    first = stored[_MODEL_PREFIX + next(iter(names))]
    out_dtype = first.properties.dtype if dtype == "auto" else DTYPES[dtype]
    assert adapter.hf is not None  # _exportable_model refused a family without one
    return _write_model(step_dir, out, stored, names, cfg, adapter.hf, extras, out_dtype, shard_bytes)


def _checked_record(step_dir: Path, verify: bool) -> Any:
    """The checkpoint's commit record, its files checked against their CRC-32C when `verify`."""
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
    return record


def _exportable_model(step_dir: Path, record: Any) -> tuple[ModelAdapter, Any, dict[str, Any]]:
    """The recorded model's family adapter, its config and its Hugging Face extras; a model the format cannot
    hold is refused here, before any tensor is read."""
    # Records written before model families existed hold Llama models.
    family = record.model.get("family", "llama")
    adapter = ADAPTERS.get(family)
    if adapter is None or adapter.hf is None:
        raise HpkitError(f"{step_dir}: a {family} model: hpkit has no Hugging Face format for that family")
    cfg = adapter.config_from_dict(record.model["config"])
    extras = dict(record.model.get("hf") or {})
    try:
        adapter.hf.to_config(cfg, extras, "float32")
    except SpecError as exc:
        raise HpkitError(f"{step_dir}: {exc}") from None
    return adapter, cfg, extras


def _checked_shapes(
    step_dir: Path, stored: dict[str, Any], adapter: ModelAdapter, cfg: Any
) -> dict[str, tuple[int, ...]]:
    """Every parameter the config implies, with its shape, each found in the checkpoint at that shape."""
    names = _parameter_shapes(adapter, cfg)
    for name, shape in names.items():
        meta = stored.get(_MODEL_PREFIX + name)
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != shape:
            found = list(meta.size) if isinstance(meta, TensorStorageMetadata) else "nothing"
            raise HpkitError(
                f"{step_dir}: {_MODEL_PREFIX + name}: the record's model config implies {list(shape)}, "
                f"the checkpoint has {found}"
            )
    return names


def _write_model(
    step_dir: Path,
    out: Path,
    stored: dict[str, Any],
    names: dict[str, tuple[int, ...]],
    cfg: Any,
    mapping: HfMapping,
    extras: dict[str, Any],
    out_dtype: torch.dtype,
    shard_bytes: int,
) -> ExportResult:
    """The safetensors shards, their index when there are several, and config.json, written into a temporary
    folder that then takes OUT's place (a failed export leaves no half of one)."""
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
            tensors = _read_group(step_dir, stored, group, cfg, mapping, out_dtype)
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            for key, value in tensors.items():
                weight_map[key] = file
                total += value.numel() * value.element_size()
            files.append(file)
        if len(groups) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        hf_config = mapping.to_config(cfg, extras, dtype_name)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked by the caller
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


# ----------------------------------------------------------------------------------------------------
# LoRA checkpoints: a PEFT adapter, or the base with the adapters merged in.

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # PeftModel(LlamaForCausalLM): its state dict's names start so


def export_lora(
    step_dir: Path,
    model: dict[str, Any],
    adapter: ModelAdapter,
    cfg: Any,
    out: Path,
    dtype: str,
    shard_bytes: int,
    merge: bool,
) -> ExportResult:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors, PEFT's tensor names, Hugging Face's
    rotary layout), which `PeftModel.from_pretrained(base, OUT)` loads; or with `merge` the base (the
    recorded init_from, checked against the recorded identity, or the seed's weights) plus scaling * B @ A
    in every targeted projection, as config.json + safetensors."""
    lora = model["lora"]
    mapping = adapter.hf
    assert mapping is not None
    adapters = _read_adapters(step_dir)
    scaling = float(lora["alpha"]) / int(lora["rank"])
    # name of the base weight (hpkit) -> (A, B) with B's rows in Hugging Face's rotary layout
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, a in adapters.items():
        if not name.endswith(".lora_A.weight"):
            continue
        base = name.removesuffix(".lora_A.weight") + ".weight"
        b = adapters[name.removesuffix(".lora_A.weight") + ".lora_B.weight"]
        heads = mapping.rotary_heads(base, cfg)
        pairs[base] = (a, to_hf_rows(b, heads) if heads is not None else b)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if merge:
            files, tensors, total, dtype_name = _write_merged(
                tmp, model, adapter, cfg, pairs, scaling, dtype, shard_bytes
            )
        else:
            files, tensors, total, dtype_name = _write_peft(tmp, model, mapping, pairs, dtype)
        if out.exists():
            out.rmdir()  # empty, checked by the caller
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(step_dir, out, files, tensors, total, dtype_name)


def _read_adapters(step_dir: Path) -> dict[str, torch.Tensor]:
    stored = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    names = [
        k for k in stored if k.startswith(_MODEL_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))
    ]
    if not names:
        raise HpkitError(
            f"{step_dir}: its record names LoRA adapters but it holds none: export another checkpoint"
        )
    state = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    return {k.removeprefix(_MODEL_PREFIX): v for k, v in state.items()}


def _write_peft(
    tmp: Path, model: dict[str, Any], mapping: HfMapping, pairs: dict[str, Any], dtype: str
) -> tuple[list[str], int, int, str]:
    lora = model["lora"]
    out_dtype = next(iter(pairs.values()))[0].dtype if dtype == "auto" else DTYPES[dtype]
    tensors: dict[str, torch.Tensor] = {}
    for base, (a, b) in pairs.items():
        stem = _PEFT_PREFIX + mapping.tensor_name(base).removesuffix(".weight")
        tensors[f"{stem}.lora_A.weight"] = a.to(out_dtype).contiguous()
        tensors[f"{stem}.lora_B.weight"] = b.to(out_dtype).contiguous()
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.get("init_from"),
        "r": int(lora["rank"]),
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": sorted(lora["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "revision": None,
    }
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return [ADAPTER_WEIGHTS], len(tensors), total, next(k for k, v in DTYPES.items() if v == out_dtype)


def _base_hf_tensors(model: dict[str, Any], adapter: ModelAdapter, cfg: Any) -> dict[str, torch.Tensor]:
    """The frozen base as Hugging Face tensors: init_from's files (refused if they are not the recorded
    base any more), or the seed's initialisation."""
    from hpkit.runtime.loop.lora import base_identity

    lora, mapping = model["lora"], adapter.hf
    assert mapping is not None
    init_from = model.get("init_from")
    if init_from is not None:
        found = base_identity(init_from, model["config"], 0)
        if found["sha256"] != lora["base"]["sha256"]:
            raise HpkitError(
                f"{init_from}: not the base these adapters were trained on (sha256 {found['sha256'][:12]}, the "
                f"checkpoint records {lora['base']['sha256'][:12]}): put that base back at {init_from}, or "
                "export the PEFT adapter (without --merge)"
            )
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(init_from).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        return tensors
    seed = int(str(lora["base"]["source"]).removeprefix("seed "))
    built = adapter.build(cfg, "cpu")
    adapter.init_weights(built, seed)
    out = {}
    for name, value in built.state_dict().items():
        if name.endswith(".weight") and not name.endswith(("lora_A.weight", "lora_B.weight")):
            heads = mapping.rotary_heads(name, cfg)
            out[mapping.tensor_name(name)] = to_hf_rows(value, heads) if heads is not None else value
    return out


def _write_merged(
    tmp: Path,
    model: dict[str, Any],
    adapter: ModelAdapter,
    cfg: Any,
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
    dtype: str,
    shard_bytes: int,
) -> tuple[list[str], int, int, str]:
    mapping = adapter.hf
    assert mapping is not None
    tensors = _base_hf_tensors(model, adapter, cfg)
    lm_head, embed = mapping.tensor_name("output.weight"), mapping.tensor_name("tok_embeddings.weight")
    if lm_head not in tensors:  # a tied base: the export is untied (to_config), so it carries the head
        tensors[lm_head] = tensors[embed].clone()
    out_dtype = tensors[embed].dtype if dtype == "auto" else DTYPES[dtype]
    for base, (a, b) in pairs.items():
        name = mapping.tensor_name(base)
        merged = tensors[name].float() + scaling * (b.float() @ a.float())
        tensors[name] = merged
    tensors = {k: v.to(out_dtype).contiguous() for k, v in tensors.items()}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    groups = _shards(shapes, out_dtype.itemsize, shard_bytes)
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        file = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in group}, str(tmp / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        files.append(file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    dtype_name = next(k for k, v in DTYPES.items() if v == out_dtype)
    hf_config = mapping.to_config(cfg, dict(model.get("hf") or {}), dtype_name)
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    return files, len(tensors), total, dtype_name
