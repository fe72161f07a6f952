"""The job spec: what a user writes in YAML, validated before anything reaches Slurm.

Every field that ends up in an sbatch script is checked here, so that rendering can stay free of
decisions and a mistake is reported as one line naming the field, not as a failed job an hour later.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpkit.errors import SpecError
from hpkit.validation import format_validation_error

# Values that land in `#SBATCH` lines are parsed by sbatch, not by a shell, so they cannot be
# quoted: they must be plain tokens.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SLURM_NAME_LIST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(,[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_SLURM_TIME = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}(:\d{1,2})?)?|UNLIMITED|INFINITE)$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A SageMaker channel becomes SM_CHANNEL_<NAME>: the name must make a valid variable name.
_CHANNEL_NAME = re.compile(r"^[A-Za-z0-9_]+$")
# A directive path may not carry whitespace, quotes or '#': sbatch would split or truncate it.
_DIRECTIVE_PATH = re.compile(r"^[^\s\"'#\\]+$")

VAR_LOG_MOUNT = "/var/log:/var/log"
HYPERPOD_LOG_DIR = "/var/log/aws/clusters"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_no_control_chars(value: str, what: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain control characters (newlines, tabs, NUL)")
    return value


class ContainerSpec(StrictModel):
    """A pyxis/enroot container for every task of the job."""

    image: str = Field(description="Registry reference (nvcr.io#nvidia/pytorch:24.07-py3) or a .sqsh path")
    mounts: list[str] = Field(default_factory=list, description="extra src:dst[:flags] bind mounts")
    mount_var_log: bool = Field(
        default=True,
        description="mount the host's /var/log (and /var/log/aws/clusters where it exists): SMDDP and HyperPod need it",
    )
    workdir: str | None = None
    startup_check: Literal["warn", "fail", "off"] = Field(
        default="warn",
        description=(
            "run the image's hpkit-entrypoint check (IMDSv2, /var/log, ...) once per node, where the image has "
            "it: warn prints what fails and goes on, fail ends the job"
        ),
    )

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("image must not be empty")
        if any(c.isspace() for c in value):
            raise ValueError("image must not contain whitespace")
        return _check_no_control_chars(value, "image")

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value: list[str]) -> list[str]:
        for mount in value:
            _check_no_control_chars(mount, "a mount")
            if "," in mount:
                raise ValueError(f"mount {mount!r} contains ',' which pyxis uses to separate mounts")
            parts = mount.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]):
                raise ValueError(f"mount {mount!r} is not of the form /host/path:/container/path[:flags]")
            src, dst = parts[0], parts[1]
            if not (src.startswith("/") and dst.startswith("/")):
                raise ValueError(f"mount {mount!r}: both paths must be absolute")
            if len(parts) == 3 and not re.fullmatch(r"[a-z+,]+", parts[2]):
                raise ValueError(f"mount {mount!r}: flags must be like ro, rw or private")
        return value


class ParallelismSpec(StrictModel):
    """Parallel degrees; their product is the world size. One degree may be -1 and is inferred.

    SageMaker model-parallel names are accepted: tensor_parallel_degree, pipeline_parallel_degree
    (or partitions), microbatches, and ddp (plain data parallel over the remaining ranks).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    microbatches: int = Field(default=1, ge=1)
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    tp_modules: list[str] | None = Field(
        default=None, description="apply tensor parallel only to these module names (None: the whole model)"
    )

    @model_validator(mode="before")
    @classmethod
    def _sagemaker_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias, canonical in (
            ("tensor_parallel_degree", "tp"),
            ("pipeline_parallel_degree", "pp"),
            ("partitions", "pp"),
        ):
            if alias in data:
                value = data.pop(alias)
                if canonical in data and data[canonical] != value:
                    raise ValueError(
                        f"{alias}={value} conflicts with {canonical}={data[canonical]}: give one"
                    )
                data[canonical] = value
        if "ddp" in data:
            ddp = data.pop("ddp")
            if not isinstance(ddp, bool):
                raise ValueError("ddp must be true or false")
            if ddp and "dp_replicate" not in data and "dp_shard" not in data:
                # SMP's ddp: replicate the model over whatever ranks tp and pp leave.
                data["dp_replicate"], data["dp_shard"] = -1, 1
        return data

    @model_validator(mode="after")
    def _degrees(self) -> ParallelismSpec:
        degrees = self.named_degrees()
        for name, value in degrees.items():
            if value == 0 or value < -1:
                raise ValueError(f"{name}={value}: a degree is a positive integer, or -1 to infer it")
        if sum(v == -1 for v in degrees.values()) > 1:
            raise ValueError("only one of dp_replicate, dp_shard, tp, pp may be -1")
        if self.pp > 1 and self.microbatches < self.pp:
            raise ValueError(f"microbatches={self.microbatches} must be >= pp={self.pp} to fill the pipeline")
        return self

    def named_degrees(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp}

    def resolve(self, world_size: int) -> dict[str, int]:
        """Degrees with -1 filled in; raises ValueError when they cannot make up world_size."""
        degrees = self.named_degrees()
        known = math.prod(v for v in degrees.values() if v != -1)
        if world_size % known:
            raise ValueError(
                f"the degrees {_fmt(degrees)} multiply to {known}, which does not divide the world size "
                f"{world_size}: make dp_replicate*dp_shard*tp*pp equal {world_size}"
            )
        for name, value in degrees.items():
            if value == -1:
                degrees[name] = world_size // known
        if math.prod(degrees.values()) != world_size:
            raise ValueError(
                f"the degrees {_fmt(degrees)} multiply to {math.prod(degrees.values())}, not the world size "
                f"{world_size}: set one degree to -1 to infer it"
            )
        return degrees


def _fmt(degrees: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in degrees.items())


class ModelSpec(StrictModel):
    """The reference Llama-style decoder: a named shape, optionally with some dimensions overridden."""

    name: Literal["debug", "125M", "1B", "8B"] = "debug"
    vocab_size: int | None = Field(default=None, ge=2, description="override the shape's vocabulary")
    seq_len: int = Field(default=256, ge=2)
    dim: int | None = Field(default=None, ge=8, description="override the hidden size")
    n_layers: int | None = Field(default=None, ge=1, description="override the number of blocks")
    n_heads: int | None = Field(default=None, ge=1, description="override the number of attention heads")
    n_kv_heads: int | None = Field(default=None, ge=1, description="override the key/value heads (GQA)")
    ffn_dim: int | None = Field(default=None, ge=1, description="override the SwiGLU hidden size")


class DataSpec(StrictModel):
    kind: Literal["synthetic", "tokens"] = "synthetic"
    path: str | None = Field(default=None, description="a flat binary file of token ids (kind: tokens)")
    dtype: Literal["uint16", "uint32"] = "uint16"

    @model_validator(mode="after")
    def _path(self) -> DataSpec:
        if self.kind == "tokens" and not self.path:
            raise ValueError("kind: tokens needs path: the token file to read")
        return self


class TrainSpec(StrictModel):
    steps: int = Field(default=20, ge=1)
    local_batch_size: int = Field(default=8, ge=1, description="sequences per data-parallel rank per step")
    lr: float = Field(default=3e-4, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    seed: int = 0
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="auto: bf16 on GPUs; fp32 on CPUs, where bf16 matmuls are slower, not faster",
    )
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    log_every: int = Field(default=1, ge=1)
    metrics_file: str | None = Field(
        default=None, description="JSONL metrics path; a relative one is inside output_dir (default: there)"
    )
    tensorboard: bool = Field(default=True, description="also write TensorBoard events when it is installed")
    data: DataSpec = Field(default_factory=DataSpec)

    @field_validator("metrics_file")
    @classmethod
    def _inside_output_dir(cls, value: str | None) -> str | None:
        if value is None:
            return None
        _check_no_control_chars(value, "metrics_file")
        if posixpath.isabs(value):
            return posixpath.normpath(value)
        normal = posixpath.normpath(value)
        if normal == ".." or normal.startswith("../") or normal == ".":
            raise ValueError(
                f"{value!r} is not a file inside output_dir: name one there, or give an absolute path"
            )
        return normal


class CheckpointSpec(StrictModel):
    dir: str | None = Field(
        default=None, description="where checkpoints go, %j standing for the job id (None: no checkpoints)"
    )
    interval: int = Field(default=100, ge=1, description="save every this many steps")
    keep: int = Field(default=2, ge=1, description="keep the newest k checkpoints")
    async_save: bool = False
    resume: bool = True
    save_final: bool = Field(default=True, description="also save after the last step")
    writer_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="files (and threads) each rank writes a checkpoint with; more help on parallel filesystems (FSx for Lustre)",
    )


class ResilienceSpec(StrictModel):
    """Preemption, time limits and lost peers: turn each into a resume from the last checkpoint."""

    signal_grace_s: int = Field(
        default=120,
        ge=5,
        le=65535,
        description="Slurm sends USR1 this long before a time-limit or preemption kill",
    )
    max_restarts: int = Field(
        default=3, ge=0, description="requeue the job at most this many times (0: never)"
    )
    collective_timeout_s: int = Field(
        default=600,
        ge=10,
        description="a collective waiting this long on a dead peer ends the job instead of hanging it",
    )


class SageMakerEnvSpec(StrictModel):
    """Export the variables SageMaker training scripts read, so that they run unchanged under Slurm.

    SM_HOSTS (JSON list of the allocation's nodes) and SM_CURRENT_HOST (each task's node) are computed
    at run time; SM_NUM_GPUS is gpus_per_node; the directories are created before the step starts.
    """

    model_dir: str | None = Field(default=None, description="SM_MODEL_DIR (default: <output_dir>/model)")
    output_data_dir: str | None = Field(
        default=None, description="SM_OUTPUT_DATA_DIR (default: <output_dir>/output)"
    )
    channels: dict[str, str] = Field(
        default_factory=dict, description="data channels: name -> path, exported as SM_CHANNEL_<NAME>"
    )

    @field_validator("model_dir", "output_data_dir")
    @classmethod
    def _dir(cls, value: str | None) -> str | None:
        if value is not None:
            if not value.strip():
                raise ValueError("a directory path must not be empty")
            _check_no_control_chars(value, "a directory path")
        return value

    @field_validator("channels")
    @classmethod
    def _channels(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not _CHANNEL_NAME.match(name):
                raise ValueError(
                    f"channel {name!r}: use letters, digits and '_' (it becomes SM_CHANNEL_{name.upper()})"
                )
            if not str(path).strip():
                raise ValueError(f"channel {name!r}: give the path of its data")
            _check_no_control_chars(str(path), f"channel {name!r}")
        upper = [n.upper() for n in value]
        clash = sorted({n for n in upper if upper.count(n) > 1})
        if clash:
            raise ValueError(
                f"channels {', '.join(clash)} differ only in case: SM_CHANNEL_ names would clash"
            )
        return value


class CollectivesSpec(StrictModel):
    """Which collective library `hpkit train` uses on GPUs (CPUs always use gloo)."""

    backend: Literal["auto", "smddp"] = Field(
        default="auto",
        description="auto: NCCL; smddp: SageMaker's data-parallel library where it imports and the type supports it",
    )
    smddp_fallback: bool = Field(
        default=False,
        description="when SMDDP cannot be used: run with NCCL (true) or stop with the reason (false)",
    )


class JobSpec(StrictModel):
    """One training job: resources, placement, container, launcher, command and training blocks."""

    name: str
    nodes: int = Field(default=1, ge=1)
    tasks_per_node: int | None = Field(
        default=None, ge=1, description="ranks per node (default: GPUs, else 1)"
    )
    gpus_per_node: int = Field(default=0, ge=0)
    cpus_per_task: int | None = Field(default=None, ge=1)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = Field(default=None, description="Slurm time: MM, HH:MM:SS, D-HH:MM ...")
    exclusive: bool = False
    output_dir: str = "logs"
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    container: ContainerSpec | None = None
    # mpi: one task per rank started by `srun --mpi=pmix` (Open MPI, mpi4py, Horovod-style programs).
    launcher: Literal["torchrun", "srun", "mpi"] = "torchrun"
    command: list[str] = Field(default_factory=lambda: ["hpkit", "train"], min_length=1)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    sagemaker_env: SageMakerEnvSpec | None = Field(
        default=None, description="export SM_HOSTS, SM_CURRENT_HOST, SM_CHANNEL_* ... for SageMaker scripts"
    )
    instance_type: str | None = Field(
        default=None, description="the EC2/SageMaker type the nodes are (ml.p4d.24xlarge): informs SMDDP"
    )
    collectives: CollectivesSpec = Field(default_factory=CollectivesSpec)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _SLURM_NAME.match(value):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' (at most 128, starting with a letter or digit)"
            )
        return value

    @field_validator("instance_type")
    @classmethod
    def _instance_type(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_NAME.match(value):
            raise ValueError("an instance type such as ml.p4d.24xlarge or p5.48xlarge")
        return value

    @field_validator("account", "qos")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_NAME.match(value):
            raise ValueError("use letters, digits, '.', '_' and '-' only")
        return value

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_NAME_LIST.match(value):
            raise ValueError(
                "a partition name, or several separated by commas, of letters, digits, '.', '_', '-'"
            )
        return value

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # YAML reads `time_limit: 30` as minutes
        if value is not None and not (isinstance(value, str) and _SLURM_TIME.match(value)):
            raise ValueError(f"{value!r} is not a Slurm time: use minutes, HH:MM:SS, D-HH:MM:SS or UNLIMITED")
        return value

    @field_validator("output_dir", "workdir")
    @classmethod
    def _directive_path(cls, value: str | None) -> str | None:
        if value is not None and not _DIRECTIVE_PATH.match(value):
            raise ValueError(
                "a path without whitespace, quotes, '#' or backslashes (sbatch reads it unquoted)"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if "\x00" in str(val):
                raise ValueError(f"{key}: a value cannot contain NUL")
        return {k: str(v) for k, v in value.items()}

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars(cls, value: Any) -> Any:
        # YAML turns `NCCL_DEBUG: 1` into an int; environment values are strings.
        if isinstance(value, dict):
            return {
                k: (str(v).lower() if isinstance(v, bool) else str(v)) if v is not None else ""
                for k, v in value.items()
            }
        return value

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as exc:
                raise ValueError(
                    f"cannot split the command string ({exc}): give a list of arguments"
                ) from exc
        if isinstance(value, list):
            return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        return value

    @field_validator("command")
    @classmethod
    def _command_nul(cls, value: list[str]) -> list[str]:
        if any("\x00" in arg for arg in value):
            raise ValueError("an argument cannot contain NUL")
        if not value[0].strip():
            raise ValueError("the program to run (first argument) is empty")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        # tasks_per_node: 1 is one process driving all the node's GPUs, as SageMaker runs a script
        # that has no distribution (torch.nn.DataParallel).
        if (
            self.tasks_per_node not in (None, 1)
            and self.gpus_per_node
            and self.tasks_per_node != self.gpus_per_node
        ):
            raise ValueError(
                f"tasks_per_node={self.tasks_per_node} differs from gpus_per_node={self.gpus_per_node}: "
                "hpkit runs one rank per GPU (or 1 per node driving all), so drop tasks_per_node"
            )
        try:
            self.parallelism.resolve(self.world_size)
        except ValueError as exc:
            raise ValueError(f"parallelism: {exc}") from None
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def parse_spec(data: Any, source: str = "spec") -> JobSpec:
    """Validate a decoded spec; SpecError carries one line per problem, each naming its field."""
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: a job spec is a mapping of keys (name, nodes, ...), not {type(data).__name__}"
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, JobSpec, source)) from None


def read_document(path: str | Path) -> Any:
    """Decode a YAML (or, by suffix, JSON) file; SpecError names the file and line on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    try:
        # YAML is a superset of JSON, but JSON's own parser gives the better message for JSON files.
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: line {exc.lineno} is not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}:{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None


def load_spec(path: str | Path) -> JobSpec:
    return parse_spec(read_document(path), str(path))
