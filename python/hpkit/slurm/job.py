"""A Slurm job of any kind, validated before anything reaches Slurm.

Every field that ends up in an sbatch script is checked here, so that rendering can stay free of
decisions and a mistake is reported as one line naming the field, not as a failed job an hour later.
Torch-free: login nodes validate and render with it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from hpkit.errors import HpkitError
from hpkit.job_identity import SLURM_NAME as _SLURM_NAME
from hpkit.job_identity import JobIdentity
from hpkit.slurm import options as slurm_options
from hpkit.smp_params import v2_problems as smp_v2_problems
from hpkit.validation import StrictModel, check_no_control_chars

# Values that land in `#SBATCH` lines are parsed by sbatch, not by a shell, so they cannot be
# quoted: they must be plain tokens.
_SLURM_NAME_LIST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(,[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A SageMaker channel becomes SM_CHANNEL_<NAME>: the name must make a valid variable name.
_CHANNEL_NAME = re.compile(r"^[A-Za-z0-9_]+$")
# A directive path may not carry whitespace, quotes or '#': sbatch would split or truncate it.
_DIRECTIVE_PATH = re.compile(r"^[^\s\"'#\\]+$")

VAR_LOG_MOUNT = "/var/log:/var/log"

_PYTHON = re.compile(r"^python[0-9.]*$")
# Interpreter options that take the next word as their value (python -W ignore, -X dev).
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "-Q"})


def is_python(program: str) -> bool:
    """Whether a command's first word is a Python interpreter (python, python3, python3.11, by any path)."""
    return bool(_PYTHON.match(program.rsplit("/", 1)[-1]))


def python_program_start(command: list[str] | tuple[str, ...]) -> int | None:
    """Where the program of `python [OPTIONS] SCRIPT|-m MODULE ARGS` starts (the index of SCRIPT or of -m); None
    for a command that is not one (another program, `python -c ...`, `python -`, an interactive interpreter)."""
    if not command or not is_python(command[0]):
        return None
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] != "-m":
        if command[i] in ("-c", "-"):
            return None
        i += 2 if command[i] in _PYTHON_OPTIONS_WITH_VALUE else 1
    return i if i < len(command) else None


# The Python a task runs where its command names none: the first python3 on the task's PATH, as the batch script
# runs its supervisor (`python3 -m hpkit.supervise`): hpkit's venv must be on the PATH jobs get (README).
TASK_PYTHON = "python3"


def as_python_program(command: list[str] | tuple[str, ...]) -> list[str]:
    """The command as a Python program where it is one in another form: hpkit's own console script, `hpkit ARGS`
    (the default command, `hpkit train`), is `python3 -m hpkit ARGS`, python3 from the task's PATH as the job's
    supervisor runs (`python3 -m hpkit.supervise`). As a Python program its ranks can start warm (hpkit.warm), and
    a spare's zygote has torch imported before a swap. Anything else, as written; `hpkit` by a path too (which
    interpreter its script names is not known here)."""
    if command and command[0] == "hpkit":
        return [TASK_PYTHON, "-m", "hpkit", *command[1:]]
    return list(command)


COMPAT_LAYERS = ("smp", "smp_v2", "smddp")
HYPERPOD_LOG_DIR = "/var/log/aws/clusters"


class ContainerSpec(StrictModel):
    """A container for every task of the job: pyxis/enroot (HyperPod) or Slurm's own OCI containers (runc)."""

    runtime: Literal["pyxis", "oci"] = Field(
        default="pyxis",
        description=(
            "pyxis: srun --container-image (enroot; HyperPod); oci: Slurm's srun --container=BUNDLE, run by the "
            "runtime in the cluster's oci.conf (runc)"
        ),
    )
    image: str = Field(
        description=(
            "pyxis: registry reference (nvcr.io#nvidia/pytorch:24.07-py3) or a .sqsh path; oci: an OCI bundle "
            "directory (rootfs + config.json, `hpkit image export --oci DIR`) on every node"
        )
    )
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
        return check_no_control_chars(value, "image")

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value: list[str]) -> list[str]:
        for mount in value:
            check_no_control_chars(mount, "a mount")
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


class SageMakerEnvSpec(StrictModel):
    """Export the variables SageMaker training scripts read, so that they run unchanged under Slurm.

    SM_HOSTS (JSON list of the step's nodes, spares left out, its rendezvous node first) and SM_CURRENT_HOST
    (each task's node) are computed at run time; SM_NUM_GPUS is gpus_per_node; the directories are created
    before the step starts.
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
            check_no_control_chars(value, "a directory path")
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
            check_no_control_chars(str(path), f"channel {name!r}")
        upper = [n.upper() for n in value]
        clash = sorted({n for n in upper if upper.count(n) > 1})
        if clash:
            raise ValueError(
                f"channels {', '.join(clash)} differ only in case: SM_CHANNEL_ names would clash"
            )
        return value


class SlurmJob(JobIdentity):
    """A Slurm job of any kind: resources, placement, container, launcher and command.

    A training job (hpkit.spec.JobSpec) holds one (its `job`) beside the training blocks; nccl-tests and the
    all-nodes check are SlurmJobs themselves, so every job kind is validated by these fields and rendered by
    hpkit.slurm.script.
    """

    document_shape: ClassVar[str] = "a Slurm job is a mapping of keys (name, nodes, ...)"
    document_source: ClassVar[str] = "job"

    nodes: int = Field(default=1, ge=1, le=slurm_options.MAX_NODES)
    tasks_per_node: int | None = Field(
        default=None,
        ge=1,
        le=slurm_options.MAX_PER_NODE,
        description="ranks per node (default: GPUs, else 1)",
    )
    gpus_per_node: int = Field(default=0, ge=0, le=slurm_options.MAX_PER_NODE)
    cpus_per_task: int | None = Field(default=None, ge=1, le=slurm_options.MAX_PER_NODE)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = Field(default=None, description="Slurm time: MM, HH:MM:SS, D-HH:MM ...")
    exclusive: bool = False
    whole_node: bool = Field(
        default=True,
        description=(
            "a job that asks for all of its instance_type's GPUs gets the whole node (--exclusive) and "
            "shares the type's vCPUs among its ranks; false: only what cpus_per_task asks for"
        ),
    )
    # Slurm placement and notification options (sbatch's names with '_' for '-'); lists are joined with ','.
    exclude: str | None = Field(default=None, description="nodes to avoid: a host list, node[3,7]")
    nodelist: str | None = Field(default=None, description="nodes to run on: a host list")
    constraint: str | None = Field(default=None, description="node features: a100&efa, [rack1|rack2]")
    mem: str | None = Field(default=None, description="memory per node: 64G, 0 for all of it")
    gres: str | None = Field(default=None, description="generic resources: nvme:1 (GPUs: gpus_per_node)")
    reservation: str | None = None
    dependency: str | None = Field(default=None, description="afterok:123[:124], singleton, ...")
    mail_type: list[str] = Field(default_factory=list, description="BEGIN, END, FAIL, ALL, ...")
    mail_user: str | None = None
    signal: str | None = Field(
        default=None,
        description="[{R|B}:]<sig>[@seconds]; replaces hpkit's B:USR1@<resilience.signal_grace_s>",
    )
    sbatch_options: list[str] = Field(
        default_factory=list, description="more sbatch options, each --name[=value] as one token"
    )
    srun_options: list[str] = Field(
        default_factory=list, description="more options for the step's srun, each --name[=value]"
    )
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    container: ContainerSpec | None = None
    # mpi: one task per rank started by `srun --mpi=pmix` (Open MPI, mpi4py, Horovod-style programs).
    launcher: Literal["torchrun", "srun", "mpi"] = "torchrun"
    command: list[str] = Field(default_factory=lambda: ["hpkit", "train"], min_length=1)
    sagemaker_env: SageMakerEnvSpec | None = Field(
        default=None, description="export SM_HOSTS, SM_CURRENT_HOST, SM_CHANNEL_* ... for SageMaker scripts"
    )
    compat: list[Literal["smp", "smp_v2", "smddp"]] = Field(
        default_factory=list,
        description=(
            "run SageMaker scripts unchanged: smp provides smdistributed.modelparallel.torch (SMP v1), smp_v2 "
            "torch.sagemaker (SMP v2), smddp smdistributed.dataparallel.torch, on hpkit's runtime (a real "
            "install of any of them still wins)"
        ),
    )
    smp_parameters: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "the estimator's SMP parameters under SMP's names, for smp.init() (compat: [smp]) or tsm.init() "
            "(compat: [smp_v2])"
        ),
    )

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
        if value is not None and not (isinstance(value, str) and slurm_options.is_slurm_time(value)):
            raise ValueError(f"{value!r} is not a Slurm time: {slurm_options.SLURM_TIME_FORMS}")
        return value

    @field_validator("exclude", "nodelist", "gres", "mail_type", mode="before")
    @classmethod
    def _comma_lists(cls, value: Any, info: Any) -> Any:
        # YAML lists are easier to write; Slurm wants one comma-separated word.
        if info.field_name == "mail_type":
            return value.split(",") if isinstance(value, str) else value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)
        return value

    @field_validator("exclude", "nodelist")
    @classmethod
    def _hostlist(cls, value: str | None) -> str | None:
        return None if value is None else slurm_options.hostlist(value)

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        return None if value is None else slurm_options.constraint(value)

    @field_validator("mem", mode="before")
    @classmethod
    def _mem(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # Slurm reads a bare number as megabytes
        return slurm_options.mem(value) if isinstance(value, str) else value

    @field_validator("gres")
    @classmethod
    def _gres(cls, value: str | None) -> str | None:
        return None if value is None else slurm_options.gres(value)

    @field_validator("reservation")
    @classmethod
    def _reservation(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_NAME_LIST.match(value):
            raise ValueError(
                "a reservation name, or several separated by commas, of letters, digits, '.', '_', '-'"
            )
        return value

    @field_validator("dependency", mode="before")
    @classmethod
    def _dependency(cls, value: Any) -> Any:
        return slurm_options.dependency(value) if isinstance(value, str) else value

    @field_validator("mail_type")
    @classmethod
    def _mail_type(cls, value: list[str]) -> list[str]:
        return slurm_options.mail_types(value)

    @field_validator("mail_user")
    @classmethod
    def _mail_user(cls, value: str | None) -> str | None:
        return None if value is None else slurm_options.mail_user(value)

    @field_validator("signal", mode="before")
    @classmethod
    def _signal(cls, value: Any) -> Any:
        return slurm_options.signal(value) if isinstance(value, str) else value

    @field_validator("sbatch_options", "srun_options")
    @classmethod
    def _extra_options(cls, value: list[str], info: Any) -> list[str]:
        command = "sbatch" if info.field_name == "sbatch_options" else "srun"
        return [slurm_options.extra_option(entry, command) for entry in value]

    # output_dir is declared in JobIdentity; only here, where it becomes an #SBATCH path, must it be a plain token.
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

    @field_validator("compat", mode="before")
    @classmethod
    def _compat(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]  # `compat: smddp` reads as the one-entry list
        if not isinstance(value, list):
            raise ValueError(f"give a list such as [smddp], not {value!r}")
        for entry in value:
            if entry not in COMPAT_LAYERS:
                raise ValueError(
                    f"{entry!r} is not a compat layer: use {', '.join(COMPAT_LAYERS)} "
                    "(smdistributed.modelparallel.torch, torch.sagemaker, smdistributed.dataparallel.torch)"
                )
        return list(dict.fromkeys(value))  # each once, in the order given

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
    def _slurm_consistent(self) -> SlurmJob:
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
        if (
            self.gpus_per_node
            and self.gres
            and any(item.split(":")[0] == "gpu" for item in self.gres.split(","))
        ):
            raise ValueError(
                "gres: GPUs come from gpus_per_node, which also sets the ranks per node: drop gpu from "
                "gres (pick a GPU model with constraint)"
            )
        per_unit = [o for o in self.sbatch_options if o.startswith(("--mem-per-cpu", "--mem-per-gpu"))]
        if self.mem is not None and per_unit:
            raise ValueError(
                f"mem: Slurm's --mem, --mem-per-cpu and --mem-per-gpu exclude each other: drop mem or {per_unit[0]}"
            )
        if self.container is not None and self.container.runtime == "oci":
            if self.launcher == "mpi":
                raise ValueError(
                    "launcher: mpi cannot run in container.runtime oci (PMIx into Slurm's OCI containers is untested "
                    "in any Slurm version): use launcher: torchrun, or srun on Slurm 24.11"
                )
            # launcher: srun depends on the cluster's Slurm version, which `hpkit submit` reads (oci_launcher_problem).
            if not self.container.image.startswith("/"):
                raise ValueError(
                    f"container.image: {self.container.image!r}: with runtime oci give the absolute path of an OCI "
                    "bundle directory on the nodes (make one with: hpkit image export --oci DIR IMAGE)"
                )
        self._smp_v2_fits()
        return self

    def _smp_v2_fits(self) -> None:
        """compat: [smp_v2]: the parameters tsm.init() would read, checked now rather than on every rank."""
        if "smp_v2" not in self.compat:
            return
        if "smp" in self.compat:
            raise ValueError(
                "compat: smp (SMP v1) and smp_v2 (torch.sagemaker) exclude each other: keep the one the script imports"
            )
        params = self.smp_parameters
        if problems := smp_v2_problems(params):
            raise ValueError(f"smp_parameters: {problems[0]}")
        world = self.world_size
        tp = int(params.get("tensor_parallel_degree") or 1)
        ep = int(params.get("expert_parallel_degree") or 1)
        if world % tp:
            raise ValueError(
                f"smp_parameters.tensor_parallel_degree={tp} does not divide the job's {world} ranks: use a divisor"
            )
        shard = int(params.get("hybrid_shard_degree") or 0) or world // tp
        if (world // tp) % shard or shard % ep:
            raise ValueError(
                f"smp_parameters: hybrid_shard_degree={shard} must divide the {world // tp} data-parallel ranks "
                f"and be a multiple of expert_parallel_degree={ep}"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


# Slurm's OCI containers (srun --container=BUNDLE) with one task each: 22.05 ran one container per node and gave
# it none of Slurm's per-task variables (SLURM_PROCID); 24.11 runs a container per task, several per node, each with
# its SLURM_PROCID, SLURM_LOCALID and SLURMD_NODENAME (both measured on the local clusters). The versions between
# were not measured: they are refused as 22.05 is.
OCI_TASKS_SINCE = (24, 11)
OCI_TASKS_SINCE_TEXT = ".".join(str(part) for part in OCI_TASKS_SINCE)


def _cluster_version(read_version: Callable[[], tuple[int, int]]) -> tuple[int, int] | HpkitError:
    """The cluster's Slurm version as read_version gives it, or the error that says why it could not be read."""
    try:
        return read_version()
    except HpkitError as exc:
        return exc


def oci_launcher_problem(job: SlurmJob, read_version: Callable[[], tuple[int, int]]) -> str | None:
    """Why this job's launcher cannot run under container.runtime oci on the cluster's Slurm, or None.

    Only launcher: srun depends on the version (torchrun starts the node's ranks inside one container; the spec
    refuses mpi), so `read_version` (`sinfo --version` at submit) is called only for it."""
    if job.container is None or job.container.runtime != "oci" or job.launcher != "srun":
        return None
    since = OCI_TASKS_SINCE_TEXT
    version = _cluster_version(read_version)
    if isinstance(version, HpkitError):
        return (
            f"launcher: srun under container.runtime oci needs Slurm {since} or later (a container per task), and "
            f"the cluster's version could not be read ({version}): make `sinfo --version` answer, or use launcher: torchrun"
        )
    if version < OCI_TASKS_SINCE:
        return (
            f"launcher: srun cannot run in container.runtime oci on Slurm {version[0]}.{version[1]:02d}: its OCI "
            "containers run one task per node and give it none of Slurm's per-task variables (SLURM_PROCID): use "
            f"launcher: torchrun, which starts the node's ranks inside the container (Slurm {since} runs one per task)"
        )
    return None


def oci_warm_problem(job: SlurmJob, warm: bool, read_version: Callable[[], tuple[int, int]]) -> str | None:
    """Why ranks cannot fork warm (resilience.warm_start) in this job's OCI containers on the cluster's Slurm, or
    None. A rank's container finds its node's zygote by the node's name (hpkit.warm.protocol.socket_path), and
    Slurm 22.05 gives every task of an OCI step task 0's variables, SLURMD_NODENAME and SLURM_PROCID included
    (measured): on one host's nodes every zygote would take the same socket, and no node's would be known."""
    if not warm or job.container is None or job.container.runtime != "oci":
        return None
    since = OCI_TASKS_SINCE_TEXT
    version = _cluster_version(read_version)
    if isinstance(version, HpkitError):
        return (
            f"resilience.warm_start in container.runtime oci needs Slurm {since} or later, and the cluster's "
            f"version could not be read ({version}): make `sinfo --version` answer, or drop warm_start"
        )
    if version < OCI_TASKS_SINCE:
        return (
            f"resilience.warm_start: ranks cannot fork warm in container.runtime oci on Slurm {version[0]}."
            f"{version[1]:02d}: its OCI containers give every task task 0's Slurm variables (SLURMD_NODENAME), "
            f"so no node's zygote can be told apart; drop warm_start, or run on Slurm {since} or later"
        )
    return None


def runs_hpkit_train(spec: SlurmJob) -> bool:
    """Whether the command is `hpkit train` (as `hpkit train` or `python -m hpkit train`)."""
    words = list(spec.command)
    return any(
        PurePosixPath(w).name == "hpkit" and words[i + 1 : i + 2] == ["train"] for i, w in enumerate(words)
    )
