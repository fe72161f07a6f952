"""The training job spec: what a user writes in YAML for `hpkit submit`, validated before anything reaches Slurm.

A JobSpec holds two parts: `job`, a SlurmJob (hpkit.slurm.job: every field that reaches the sbatch script), and
`run`, a RunConfig (hpkit.runtime.config: the training blocks `hpkit train` reads); and it owns the checks that
need both. The YAML stays flat: both parts' keys at its top level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import model_validator

from hpkit.errors import SpecError
from hpkit.job_identity import JobIdentity
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
from hpkit.slurm.job import (
    COMPAT_LAYERS,
    HYPERPOD_LOG_DIR,
    VAR_LOG_MOUNT,
    ContainerSpec,
    SageMakerEnvSpec,
    SlurmJob,
    as_python_program,
    python_program_start,
    runs_hpkit_train,
)
from hpkit.validation import UNKNOWN_KEY, StrictModel, parse_document, read_document

# The training blocks live with the runtime's configuration; they are part of every job spec.
__all__ = [
    "COMPAT_LAYERS",
    "HYPERPOD_LOG_DIR",
    "SNAPSHOT_HEADER",
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
    "load_parts",
    "load_run_config",
]


class JobSpec(StrictModel):
    """One training job: the Slurm job it runs as (`job`: resources, placement, container, launcher, command) and
    the training blocks `hpkit train` reads (`run`).

    The YAML stays flat: a document's keys go to the part that declares them. The identity keys (name,
    output_dir, instance_type: hpkit.job_identity.JobIdentity, which both parts are) are written once and go
    to both, so the two parts always name the same job; a problem with one is said once, under its own key.
    """

    document_shape: ClassVar[str] = "a job spec is a mapping of keys (name, nodes, ...)"
    document_source: ClassVar[str] = "spec"
    flat_parts: ClassVar[tuple[str, ...]] = ("run", "job")

    # run first: a document's problems are listed as they were when JobSpec inherited both (identity, training
    # blocks, then Slurm's keys), and document() keeps the snapshot's key order.
    run: RunConfig
    job: SlurmJob

    @model_validator(mode="before")
    @classmethod
    def _split(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if (
            set(data) == {"job", "run"}
            and isinstance(data["job"], SlurmJob)
            and isinstance(data["run"], RunConfig)
        ):
            return data  # built from its parts in Python: JobSpec(job=..., run=...)
        # A key neither part declares goes to the Slurm job, which names it as unknown; the message lists every
        # key of the spec (hpkit.validation.document_fields).
        return {
            "run": {k: v for k, v in data.items() if k in RunConfig.model_fields},
            "job": {k: v for k, v in data.items() if k not in _TRAINING_BLOCKS},
        }

    @model_validator(mode="after")
    def _one_identity(self) -> JobSpec:
        # Only parts built apart can differ: a document gives both parts the same keys.
        for key in JobIdentity.model_fields:
            ours, theirs = getattr(self.job, key), getattr(self.run, key)
            if ours != theirs:
                raise ValueError(
                    f"{key}: the job part has {ours!r}, the run part {theirs!r}: build both with the same {key}"
                )
        return self

    @model_validator(mode="after")
    def _parallelism_fits(self) -> JobSpec:
        parallelism = self.run.parallelism
        try:
            degrees = parallelism.resolve(self.job.world_size)
        except ValueError as exc:
            raise ValueError(f"parallelism: {exc}") from None
        if problem := parallelism.pipeline_problem(degrees["pp"]):  # pp: -1 is known only now
            raise ValueError(f"parallelism: {problem}")
        return self

    @model_validator(mode="after")
    def _memory_copies_fit(self) -> JobSpec:
        memory, nodes = self.run.checkpoint.memory, self.job.nodes
        if memory is not None and memory.replicas >= nodes:
            raise ValueError(
                f"checkpoint.memory.replicas: {memory.replicas} copies on other nodes need at least "
                f"{memory.replicas + 1} nodes (nodes: {nodes}); add nodes or remove checkpoint.memory"
            )
        return self

    @model_validator(mode="after")
    def _warm_start_applies(self) -> JobSpec:
        resilience = self.run.resilience
        if resilience.warm_start and (problem := warm_start_problem(self.job)):
            raise ValueError(f"resilience.warm_start: {problem}, or drop warm_start")
        if resilience.keep_survivors and not runs_hpkit_train(self.job):
            raise ValueError(
                "resilience.keep_survivors: only hpkit train's ranks stay in their processes (the command is not "
                "`hpkit train`); run hpkit train, or drop keep_survivors"
            )
        if resilience.keep_survivors and not self.warm_starts:
            raise ValueError(
                "resilience.keep_survivors: a rank stays in a process its node's warm process forked, and the ranks "
                f"of this job start cold ({self._cold_why()}); turn resilience.warm_start on, or drop keep_survivors"
            )
        if resilience.warm_preload and not self.warm_starts:
            raise ValueError(
                f"resilience.warm_preload: the ranks start cold in this job ({self._cold_why()}), so nothing would "
                "preload them; start them warm, or drop warm_preload"
            )
        return self

    def _cold_why(self) -> str:
        """Why a job's ranks start cold (warm_starts is false)."""
        return (
            "warm_start: false"
            if self.run.resilience.warm_start is False
            else warm_start_problem(self.job)
            or (
                "warm starts are off in a container unless warm_start: true"
                if self.job.container is not None
                else "warm starts are off on GPU nodes unless warm_start: true"
            )
        )

    @property
    def warm_starts(self) -> bool:
        """Whether the ranks are forked warm (hpkit.warm): resilience.warm_start as written; left out, wherever they
        can be in a job that asks for no GPUs. A forked rank lives in its zygote's step, not in its own: whether
        that step's cgroup holds the node's GPUs as the rank's step would is not yet checked on a GPU cluster."""
        chosen = self.run.resilience.warm_start
        if chosen is not None:
            return chosen
        # In a container only when asked: Slurm 22.05 cannot tell one node's OCI container from another's, which
        # `hpkit submit` checks against the cluster's version (hpkit.slurm.job.oci_warm_problem).
        return (
            self.job.gpus_per_node == 0
            and self.job.container is None
            and warm_start_problem(self.job) is None
        )

    @property
    def keeps_survivors(self) -> bool:
        """Whether the ranks whose group broke stay in their processes for the next step (resilience.keep_survivors,
        or its default): only `hpkit train`'s ranks, forked warm."""
        return (
            self.warm_starts
            and runs_hpkit_train(self.job)
            and self.run.resilience.survivors_stay(on_gpus=self.job.gpus_per_node > 0)
        )

    @property
    def signal_grace_s(self) -> int:
        """Seconds between the warning signal and the kill: from `signal` when given (Slurm's default
        is 60), else resilience.signal_grace_s."""
        if self.job.signal is None:
            return self.run.resilience.signal_grace_s
        _, _, seconds = self.job.signal.partition("@")
        return int(seconds) if seconds else 60

    def document(self) -> dict[str, Any]:
        """The spec as the flat document a user writes, in JSON's values: the snapshot `hpkit submit` writes
        for the job, which `hpkit train` reads back. Keys in the order identity, training blocks, Slurm's."""
        return {**self.run.model_dump(mode="json"), **self.job.model_dump(mode="json")}


def warm_start_problem(job: SlurmJob) -> str | None:
    """Why the job's ranks cannot be forked warm (hpkit.warm.protocol.python_target says which commands a zygote
    starts), or None."""
    # Every launcher's ranks can be: torchrun's agent, or srun's task (launcher srun, and mpi, whose forked ranks
    # still wire up through the step's PMIx server: test_mpi_jobs), starts the client in the rank's place.
    if job.container is not None and job.container.runtime != "oci":
        # A pyxis/enroot container's /dev/shm, where the zygote's socket lives, is the node's only where the site's
        # enroot binds it: enroot's current conf/mounts/10-system.fstab binds the host's /dev/shm, older ones bound
        # /dev read-only and nothing else, and sites edit that file. No pyxis here to try it on: refused until then.
        return (
            "ranks are forked warm only outside a container or in Slurm's own OCI containers (container.runtime: "
            "oci); use runtime oci, or drop the container"
        )
    if python_program_start(as_python_program(job.command)) != 1:
        return (
            "the command must be a Python program without interpreter options (python SCRIPT or python -m "
            "MODULE, e.g. python -m hpkit train); change the command"
        )
    return None


# The keys only the run configuration has: every other key of a document goes to the Slurm job.
_TRAINING_BLOCKS = frozenset(RunConfig.model_fields) - frozenset(JobIdentity.model_fields)


def load_run_config(path: str | Path) -> RunConfig:
    """What `hpkit train --config` reads: a whole job spec (validated as `hpkit submit` did) or a file of
    bare training blocks. It lives here, above both models, so that the training configuration never
    has to know about job specs."""
    return load_parts(path)[1]


# The first line of the snapshot `hpkit submit` writes for a job (hpkit.jobs.submission.snapshot_text): a reader
# that meets a key it does not know in such a file knows that no user wrote it.
SNAPSHOT_HEADER = (
    "# written by hpkit submit: the job's spec as every rank reads it back (hpkit train --config)\n"
)


def load_parts(path: str | Path) -> tuple[SlurmJob | None, RunConfig]:
    """A training file's Slurm job and run configuration: both parts of a whole job spec, or (None, the run
    configuration) for a file of bare training blocks; for readers inside a job that need the spec's Slurm
    fields too (its command, its smp_parameters)."""
    data = read_document(path)
    try:
        if isinstance(data, dict) and "name" in data and not set(data) <= set(RunConfig.model_fields):
            spec = parse_document(JobSpec, data, str(path))
            return spec.job, spec.run
        return None, parse_document(RunConfig, data, str(path))
    except SpecError as exc:
        if f": {UNKNOWN_KEY};" in str(exc) and _is_snapshot(path):
            raise SpecError(
                f"{exc}\n{path}: hpkit submit wrote this file with keys this hpkit does not know: the hpkit where "
                "the job runs (in its image or environment) is older than the one that submitted it; install the "
                "same hpkit in both"
            ) from None
        raise


def _is_snapshot(path: str | Path) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline() == SNAPSHOT_HEADER
    except (OSError, UnicodeDecodeError):
        return False
