"""The training job spec: what a user writes in YAML for `hpkit submit`, validated before anything reaches Slurm.

A JobSpec is a SlurmJob (hpkit.slurm_job: every field that reaches the sbatch script) plus the training
blocks of RunConfig (hpkit.runtime.config: what `hpkit train` reads), and the checks that need both.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import model_validator

from hpkit.runtime.config import (
    CheckpointSpec,
    CollectivesSpec,
    DataSpec,
    ModelSpec,
    ParallelismSpec,
    ResilienceSpec,
    RunConfig,
    TrainSpec,
)
from hpkit.slurm_job import (
    COMPAT_LAYERS,
    HYPERPOD_LOG_DIR,
    VAR_LOG_MOUNT,
    ContainerSpec,
    SageMakerEnvSpec,
    SlurmJob,
    python_program_start,
)
from hpkit.validation import parse_document, read_document

# The training blocks live with the runtime's configuration; they are part of every job spec.
__all__ = [
    "COMPAT_LAYERS",
    "HYPERPOD_LOG_DIR",
    "VAR_LOG_MOUNT",
    "CheckpointSpec",
    "CollectivesSpec",
    "ContainerSpec",
    "DataSpec",
    "JobSpec",
    "ModelSpec",
    "ParallelismSpec",
    "ResilienceSpec",
    "SageMakerEnvSpec",
    "SlurmJob",
    "TrainSpec",
    "load_run_config",
]


class JobSpec(SlurmJob, RunConfig):
    """One training job: a SlurmJob (resources, placement, container, launcher, command) plus the training
    blocks of RunConfig. The YAML stays flat: both sets of keys at the top level."""

    document_shape: ClassVar[str] = "a job spec is a mapping of keys (name, nodes, ...)"
    document_source: ClassVar[str] = "spec"
    # Said here, not left to the MRO: RunConfig lets a bare training file omit its name; a job spec must name
    # its Slurm job.
    default_name: ClassVar[str | None] = None

    @model_validator(mode="after")
    def _parallelism_fits(self) -> JobSpec:
        try:
            degrees = self.parallelism.resolve(self.world_size)
        except ValueError as exc:
            raise ValueError(f"parallelism: {exc}") from None
        if problem := self.parallelism.pipeline_problem(degrees["pp"]):  # pp: -1 is known only now
            raise ValueError(f"parallelism: {problem}")
        return self

    @model_validator(mode="after")
    def _memory_copies_fit(self) -> JobSpec:
        memory = self.checkpoint.memory
        if memory is not None and memory.replicas >= self.nodes:
            raise ValueError(
                f"checkpoint.memory.replicas: {memory.replicas} copies on other nodes need at least "
                f"{memory.replicas + 1} nodes (nodes: {self.nodes}); add nodes or remove checkpoint.memory"
            )
        return self

    @model_validator(mode="after")
    def _warm_start_applies(self) -> JobSpec:
        if not self.resilience.warm_start:
            return self
        if self.launcher != "torchrun" or self.container is not None:
            raise ValueError(
                "resilience.warm_start: ranks are forked warm under launcher: torchrun without a container; "
                "use that launcher, or drop warm_start"
            )
        if python_program_start(self.command) is None:
            raise ValueError(
                "resilience.warm_start: the command must be a Python program (python SCRIPT or python -m MODULE, "
                "e.g. python -m hpkit train); change the command, or drop warm_start"
            )
        return self

    @property
    def signal_grace_s(self) -> int:
        """Seconds between the warning signal and the kill: from `signal` when given (Slurm's default
        is 60), else resilience.signal_grace_s."""
        if self.signal is None:
            return self.resilience.signal_grace_s
        _, _, seconds = self.signal.partition("@")
        return int(seconds) if seconds else 60


def load_run_config(path: str | Path) -> RunConfig:
    """What `hpkit train --config` reads: a whole job spec (validated as `hpkit submit` did) or a file of
    bare training blocks. It lives here, above both models, so that the training configuration never
    has to know about job specs."""
    data = read_document(path)
    if isinstance(data, dict) and "name" in data and not set(data) <= set(RunConfig.model_fields):
        return parse_document(JobSpec, data, str(path))
    return parse_document(RunConfig, data, str(path))
