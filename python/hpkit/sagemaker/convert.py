"""Estimator → hpkit job spec. What carries over is mapped; what does not becomes a warning saying what
to do instead, so that nothing is dropped silently.

- nodes from instance_count; GPUs per node from hpkit's instance catalog (hpkit/catalog.py)
- launcher from the distribution: mpi → `mpi` (srun --mpi=pmix), pytorchddp / torch_distributed /
  smdistributed.dataparallel → `torchrun`, none → one process per node (`srun`), as SageMaker runs it
- smdistributed.modelparallel parameters → `parallelism` (tp, pp, microbatches, ddp) and, as given,
  `smp_parameters`; smdistributed.dataparallel → `collectives.backend: smddp`. Either turns on the
  matching `compat` layer, which runs the script's smp / smddp calls on hpkit (hpkit/compat)
- hyperparameters → `--name value` arguments of the entry point; `sagemaker_env` on, so that scripts
  reading SM_HOSTS / SM_CURRENT_HOST / SM_CHANNEL_* run unchanged
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from pydantic import ValidationError

from hpkit.catalog import SMDDP_TYPES, lookup, smddp_verdict
from hpkit.errors import SpecError
from hpkit.sagemaker.estimator import Estimator
from hpkit.smp_params import SMP_PIPELINES, unknown_advice
from hpkit.smp_params import lookup as smp_lookup
from hpkit.smp_params import v2_lookup as smp_v2_lookup
from hpkit.smp_params import v2_problems as smp_v2_problems
from hpkit.spec import JobSpec, ParallelismSpec
from hpkit.validation import format_validation_error, parse_document

SAGEMAKER_INPUT_DIR = "/opt/ml/input/data"


@dataclass(frozen=True)
class ImportWarning:
    field: str  # where in the estimator description
    problem: str
    fix: str

    def line(self) -> str:
        return f"{self.field}: {self.problem}; instead: {self.fix}"


@dataclass(frozen=True)
class Imported:
    data: dict[str, Any]  # the job spec as it is written out
    spec: JobSpec
    warnings: list[ImportWarning]
    notes: list[str] = field(default_factory=list)  # what changed meaning on the way, nothing to fix


# SageMaker-only estimator arguments: what to do on Slurm instead.
ESTIMATOR_ONLY: dict[str, str] = {
    "role": "drop it: Slurm jobs run as the submitting user",
    "sagemaker_session": "drop it",
    "framework_version": "the image decides the PyTorch version (docker/versions.env); drop it",
    "py_version": "the image decides the Python version; drop it",
    "image_uri": "set container.image to an image enroot can import (make image-sqsh), or run without one",
    "output_path": "model files stay in SM_MODEL_DIR (<output_dir>/model); copy them to S3 after the job",
    "checkpoint_s3_uri": "set checkpoint.dir to shared storage (FSx) for `hpkit train`, or copy to S3 yourself",
    "checkpoint_local_path": "set checkpoint.dir to shared storage (FSx) for `hpkit train`",
    "use_spot_instances": "submit to a preemptible partition: hpkit requeues on preemption (resilience.max_restarts)",
    "max_wait": "drop it: Slurm's time_limit is the only limit",
    "volume_size": "drop it: nodes use the cluster's storage",
    "volume_kms_key": "drop it: encryption is the storage's setting",
    "output_kms_key": "drop it: encryption is the storage's setting",
    "subnets": "drop it: the cluster's network is fixed",
    "security_group_ids": "drop it: the cluster's network is fixed",
    "enable_network_isolation": "drop it: the cluster's network is fixed",
    "encrypt_inter_container_traffic": "drop it: the cluster's network is fixed",
    "tags": "drop it; Slurm has --comment for bookkeeping",
    "metric_definitions": "print metrics to the job's log, or use `hpkit train`'s JSONL/TensorBoard metrics",
    "enable_sagemaker_metrics": "drop it",
    "debugger_hook_config": "drop it: SageMaker Debugger does not run on Slurm",
    "profiler_config": "drop it: use torch.profiler",
    "disable_profiler": "drop it",
    "keep_alive_period_in_seconds": "drop it: Slurm nodes stay up",
    "dependencies": "put them in the image or the shared virtual environment",
    "git_config": "check out the code on shared storage and set workdir",
    "code_location": "drop it: the code is read from shared storage",
    "container_log_level": "drop it",
    "compiler_config": "drop it: SageMaker Training Compiler does not run on Slurm; try train.compile",
}


class _Converter:
    def __init__(self, est: Estimator, source: str):
        self.est = est
        self.source = source
        self.warnings: list[ImportWarning] = []
        self.errors: list[str] = []
        self.notes: list[str] = []

    def warn(self, field: str, problem: str, fix: str) -> None:
        self.warnings.append(ImportWarning(field, problem, fix))

    def error(self, field: str, message: str) -> None:
        self.errors.append(f"{self.source}: {field}: {message}")

    def enabled(self, block: Any, field: str) -> bool:
        """SageMaker's `enabled` flag: a bool, or the strings "true"/"false" some examples use."""
        if block is None:
            return False
        if not isinstance(block, dict):
            self.error(field, f"expected a mapping such as {{enabled: true}}, not {block!r}")
            return False
        value = block.get("enabled", False)
        if "enable" in block and "enabled" not in block:
            self.warn(
                f"{field}.enable",
                "unknown key: SageMaker reads 'enabled', so this distribution was off there too; imported as off",
                f"write {field}.enabled: true if you meant it on, and import again",
            )
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            self.error(f"{field}.enabled", f"expected true or false, not {value!r}")
            return False
        return value


def _time_limit(seconds: int) -> str:
    minutes = -(-seconds // 60)  # Slurm counts whole minutes; round up so the job is not cut short
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def _argument(value: Any) -> str:
    """A hyperparameter value as a command-line word: str() for scalars, JSON for lists and maps."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _job_name(est: Estimator, name: str | None) -> str:
    raw = name or est.base_job_name or PurePosixPath(est.entry_point).stem or "sagemaker-job"
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._")[:128]
    return cleaned or "sagemaker-job"


def _command(est: Estimator) -> list[str]:
    path = str(PurePosixPath(est.source_dir) / est.entry_point) if est.source_dir else est.entry_point
    if path.endswith(".py"):
        program = ["python3", path]
    elif path.endswith(".sh"):
        program = ["bash", path]
    else:
        program = [path]
    args: list[str] = []
    for key, value in est.hyperparameters.items():
        args += [f"--{key}", _argument(value)]
    return program + args


def convert(est: Estimator, source: str = "estimator", name: str | None = None) -> Imported:
    c = _Converter(est, source)
    data: dict[str, Any] = {"name": _job_name(est, name), "nodes": est.instance_count}
    row = lookup(est.instance_type)
    gpus = row.gpus if row else 0
    if row is None:
        c.warn(
            "instance_type",
            f"{est.instance_type} is not a GPU type in hpkit's instance catalog (hpkit/catalog.py), so the spec "
            "requests no GPUs",
            "set gpus_per_node if these nodes have GPUs",
        )
    data["instance_type"] = est.instance_type
    launcher, ranks, extra = _distribution(c, gpus)
    if gpus:
        data["gpus_per_node"] = gpus
        if ranks == 1 and gpus > 1:
            data["tasks_per_node"] = 1
    elif ranks > 1:
        data["tasks_per_node"] = ranks
    data["launcher"] = launcher
    env = {str(k): _argument(v) for k, v in est.environment.items()}
    env.update(extra.pop("env", {}))
    if env:
        data["env"] = env
    data["command"] = _command(est)
    data.update(extra)
    data["sagemaker_env"] = _sagemaker_env(c)
    if est.max_run is not None:
        data["time_limit"] = _time_limit(est.max_run)
    if est.max_retry_attempts is not None:
        data["resilience"] = {"max_restarts": est.max_retry_attempts}
    for key in est.extra_keys():
        fix = ESTIMATOR_ONLY.get(key, "drop it: it has no meaning outside SageMaker")
        c.warn(key, "SageMaker-only option, not carried over", fix)
    if c.errors:
        raise SpecError("\n".join(c.errors))
    try:
        spec = parse_document(JobSpec, data, f"{source} (imported spec)")
    except SpecError as exc:
        raise SpecError(f"{exc}\n{source}: fix the estimator description above, then import again") from None
    return Imported(data=data, spec=spec, warnings=c.warnings, notes=c.notes)


def _distribution(c: _Converter, gpus: int) -> tuple[str, int, dict[str, Any]]:
    """(launcher, ranks per node, extra spec keys) from the distribution block."""
    dist = c.est.distribution
    extra: dict[str, Any] = {}
    known = {"mpi", "smdistributed", "pytorchddp", "torch_distributed"}
    for key in dist:
        if key not in known:
            c.warn(
                f"distribution.{key}",
                "not supported on Slurm by hpkit (TensorFlow or heterogeneous-cluster option)",
                "use torch.distributed (torchrun) or MPI (launcher: mpi) and import again",
            )
    smd = dist.get("smdistributed") or {}
    if not isinstance(smd, dict):
        c.error("distribution.smdistributed", "expected a mapping with dataparallel or modelparallel")
        smd = {}
    for key in smd:
        if key not in ("dataparallel", "modelparallel"):
            c.warn(f"distribution.smdistributed.{key}", "unknown smdistributed library", "drop it")
    mpi_on = c.enabled(dist.get("mpi"), "distribution.mpi")
    ddp_on = c.enabled(dist.get("pytorchddp"), "distribution.pytorchddp")
    torch_on = c.enabled(dist.get("torch_distributed"), "distribution.torch_distributed")
    smddp_on = c.enabled(smd.get("dataparallel"), "distribution.smdistributed.dataparallel")
    smp_on = c.enabled(smd.get("modelparallel"), "distribution.smdistributed.modelparallel")

    # SMP v2 (torch.sagemaker) is launched by torch_distributed and takes v2's parameters; v1 by mpi.
    smp_v2 = smp_on and not mpi_on and (torch_on or _v2_parameters(smd["modelparallel"]))
    if smp_v2:
        extra.update(_modelparallel_v2(c, smd["modelparallel"]))
    elif smp_on:
        extra.update(_modelparallel(c, smd["modelparallel"]))
    if smddp_on:
        extra["collectives"] = _dataparallel(c, smd["dataparallel"])
    layers = (("smp_v2", smp_v2), ("smp", smp_on and not smp_v2), ("smddp", smddp_on))
    compat = [layer for layer, on in layers if on]
    if compat:
        extra["compat"] = compat
    if mpi_on:
        ranks, env = _mpi(c, dist["mpi"], gpus)
        if env:
            extra["env"] = env
        return "mpi", ranks, extra
    if ddp_on or torch_on or smddp_on or smp_on:
        return "torchrun", gpus or 1, extra
    # No distribution: SageMaker starts the entry point once per instance, seeing all its GPUs.
    return "srun", 1, extra


def _mpi(c: _Converter, block: dict[str, Any], gpus: int) -> tuple[int, dict[str, str]]:
    field = "distribution.mpi"
    for key in block:
        if key not in ("enabled", "enable", "processes_per_host", "custom_mpi_options"):
            c.warn(f"{field}.{key}", "unknown mpi option, not carried over", "drop it")
    pph = block.get("processes_per_host", gpus or 1)
    if not isinstance(pph, int) or isinstance(pph, bool) or pph < 1:
        c.error(f"{field}.processes_per_host", f"expected a positive integer, not {pph!r}")
        pph = 1
    ranks = pph
    if gpus and pph not in (1, gpus):
        c.warn(
            f"{field}.processes_per_host",
            f"{pph} processes on {gpus}-GPU nodes: hpkit runs one rank per GPU, so the spec has {gpus}",
            "keep it, or set gpus_per_node and tasks_per_node by hand",
        )
        ranks = gpus
    env = _mpi_options(c, block.get("custom_mpi_options"), f"{field}.custom_mpi_options")
    return ranks, env


def _mpi_options(c: _Converter, options: Any, field: str) -> dict[str, str]:
    """mpirun's `--mca name value` and `-x NAME=value` carry over as environment variables."""
    if not options:
        return {}
    try:
        words = shlex.split(str(options))
    except ValueError as exc:
        c.error(field, f"cannot split {options!r}: {exc}")
        return {}
    env: dict[str, str] = {}
    dropped: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("--mca", "-mca") and i + 2 < len(words):
            env[f"OMPI_MCA_{words[i + 1]}"] = words[i + 2]
            i += 3
        elif word == "-x" and i + 1 < len(words):
            name, sep, value = words[i + 1].partition("=")
            if sep:
                env[name] = value
            # `-x NAME` alone passes NAME through, which Slurm does for every variable already.
            i += 2
        else:
            dropped.append(word)
            i += 1
    if dropped:
        c.warn(
            field,
            f"mpirun options {' '.join(dropped)!r} have no srun equivalent here (--mca and -x carry over as "
            "OMPI_MCA_* and env)",
            "set the matching OMPI_MCA_* variables in env, or srun options in the cluster's config",
        )
    return env


def _modelparallel(c: _Converter, block: dict[str, Any]) -> dict[str, Any]:
    field = "distribution.smdistributed.modelparallel"
    params = block.get("parameters") or {}
    if not isinstance(params, dict):
        c.error(f"{field}.parameters", "expected a mapping of SMP parameters")
        return {}
    for key in block:
        if key not in ("enabled", "enable", "parameters"):
            c.warn(f"{field}.{key}", "unknown modelparallel option, not carried over", "drop it")
    carried = {"tensor_parallel_degree", "pipeline_parallel_degree", "partitions", "microbatches", "ddp"}
    degrees = {k: v for k, v in params.items() if k in carried}
    extra: dict[str, Any] = {}
    try:
        parallelism = ParallelismSpec.model_validate(degrees)
    except ValidationError as exc:
        c.errors.append(format_validation_error(exc, ParallelismSpec, c.source, (f"{field}.parameters",)))
        return {}
    out = parallelism.model_dump(exclude_defaults=True, exclude_none=True)
    if "pipeline" in params:
        schedule = SMP_PIPELINES.get(str(params["pipeline"]))
        if schedule:
            out["pp_schedule"] = schedule
        else:
            c.warn(
                f"{field}.parameters.pipeline", f"unknown pipeline {params['pipeline']!r}", "set pp_schedule"
            )
    if out:
        extra["parallelism"] = out
    if params.get("bf16") is True:
        extra["train"] = {"mixed_precision": "bf16"}
    # One table (hpkit.smp_params) for the importer and smp.init: what the shim would refuse is an
    # error here, before anything is submitted; what it ignores is a warning and stays in the spec.
    kept: dict[str, Any] = {}
    for key, value in params.items():
        known = smp_lookup(key)
        where = f"{field}.parameters.{key}"
        if known is None:
            c.error(where, unknown_advice(key))
        elif known.refuses(value):
            c.error(where, f"SMP parameter {key}={value!r} is not supported by hpkit: {known.advice}")
        else:
            kept[key] = value
            if known.status == "ignored":
                c.warn(where, f"SMP parameter {key}={value!r} changes nothing here", known.advice)
    if kept:
        extra["smp_parameters"] = kept
    c.notes.append(
        f"{field}: compat: [smp] runs the script's smdistributed.modelparallel.torch calls on hpkit's runtime "
        "(degrees from parallelism, the rest from smp_parameters); a real SMP install in the image still wins"
    )
    return extra


def _v2_parameters(block: Any) -> bool:
    params = block.get("parameters") if isinstance(block, dict) else None
    v2_only = {
        "hybrid_shard_degree",
        "expert_parallel_degree",
        "context_parallel_degree",
        "sm_activation_offloading",
    }
    return isinstance(params, dict) and bool(v2_only & set(params))


def _modelparallel_v2(c: _Converter, block: dict[str, Any]) -> dict[str, Any]:
    field = "distribution.smdistributed.modelparallel"
    params = block.get("parameters") or {}
    if not isinstance(params, dict):
        c.error(f"{field}.parameters", "expected a mapping of SMP v2 parameters")
        return {}
    for key in block:
        if key not in ("enabled", "enable", "parameters"):
            c.warn(f"{field}.{key}", "unknown modelparallel option, not carried over", "drop it")
    # One table (hpkit.smp_params, v2 part) for the importer and tsm.init: what tsm.init refuses is refused here.
    kept: dict[str, Any] = {}
    for key, value in params.items():
        where = f"{field}.parameters.{key}"
        problems = smp_v2_problems({key: value})
        if problems:
            c.error(where, problems[0])
            continue
        kept[key] = value
        known = smp_v2_lookup(key)
        if known is not None and known.status == "ignored":
            c.warn(where, f"SMP v2 parameter {key}={value!r} changes nothing here", known.advice)
    c.notes.append(
        f"{field}: compat: [smp_v2] runs the script's torch.sagemaker calls (tsm.init, transform, its FSDP, the "
        "v2 checkpoint API) on torch-native FSDP2, tensor and expert parallel; smp_parameters is what tsm.init() "
        "reads when the script passes no config; a real SMP v2 install in the image still wins"
    )
    return {"smp_parameters": kept} if kept else {}


def _dataparallel(c: _Converter, block: dict[str, Any]) -> dict[str, Any]:
    field = "distribution.smdistributed.dataparallel"
    for key in block:
        if key == "custom_mpi_options":
            c.warn(f"{field}.{key}", "SMDDP is launched by torchrun here, not mpirun", "drop it")
        elif key not in ("enabled", "enable"):
            c.warn(f"{field}.{key}", "unknown dataparallel option, not carried over", "drop it")
    c.notes.append(
        f'{field}: compat: [smddp] runs the script\'s backend "smddp" as an alias of NCCL (gloo on CPU) where '
        "the SMDDP library is absent; an image built with --build-arg SMDDP_WHEEL_URL=<wheel> runs the real one "
        "on the types it supports. collectives.smddp_fallback: false refuses to run without it"
    )
    verdict = smddp_verdict(c.est.instance_type)
    if verdict:
        c.warn(
            "instance_type",
            f"{verdict}, so the script's smddp backend runs as hpkit's NCCL alias",
            f"use {' or '.join(SMDDP_TYPES)} for SMDDP itself; nothing to do to run on NCCL",
        )
    # fallback: the alias (compat) or NCCL (`hpkit train`) where SMDDP cannot run, as the note says.
    return {"backend": "smddp", "smddp_fallback": True}


def _sagemaker_env(c: _Converter) -> dict[str, Any]:
    inputs = c.est.inputs
    if inputs is None:
        return {"channels": {}}
    channels_in = {"training": inputs} if isinstance(inputs, str) else dict(inputs)
    channels: dict[str, str] = {}
    for name, uri in channels_in.items():
        if uri.startswith("file://"):
            channels[name] = uri.removeprefix("file://")
        elif "://" in uri:
            # Where SageMaker would have put it; the script sees the same path, the data must be copied.
            channels[name] = f"{SAGEMAKER_INPUT_DIR}/{name}"
            c.warn(
                f"inputs.{name}",
                f"{uri} is not downloaded by Slurm",
                f"copy it to shared storage (FSx) and set sagemaker_env.channels.{name} to that path",
            )
        else:
            channels[name] = uri
    return {"channels": channels}
