"""One training layout: the parallel degrees, the pipeline schedule, activation checkpointing, batch and precision.

The planner's unit of choice, and the bridge to a job spec: `Layout.from_run_config` reads the spec's
parallelism and train blocks (degrees resolved for the world, as hpkit.runtime.parallel.parallel_dims does) and
`to_parallelism` / `train_fields` write them back. Which of FSDP, HSDP and DDP a layout gets is asked of the
runtime's ParallelDims (torch-free to import), never restated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from hpkit.errors import SpecError
from hpkit.layout_rules.pipeline import MULTI_STAGE_SCHEDULES, Schedule
from hpkit.runtime.config import ParallelismSpec, resolve_mixed_precision
from hpkit.runtime.parallel.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from hpkit.runtime.config import RunConfig

AC = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: Schedule = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 1
    activation_checkpoint: AC = "none"
    local_batch_size: int = 1  # sequences per data-parallel rank per step
    precision: Precision = "bf16"
    # Whole-model TP shards the residual stream along the sequence; None: the runtime's default (on for
    # CUDA, off on CPU: hpkit.runtime.parallel.tensor_parallel.sequence_parallel_default).
    sequence_parallel: bool | None = None

    # ---- derived -----------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep * self.tp * self.pp

    @property
    def dims(self) -> ParallelDims:
        """The runtime's own reading of these degrees: which of FSDP, HSDP and DDP it applies is its rule, not
        a copy of it here."""
        return ParallelDims(self.dp_replicate, self.dp_shard, self.tp, self.pp, self.world, self.ep)

    @property
    def dp(self) -> int:
        """Ranks that read different data: data-parallel and expert-parallel ones."""
        return self.dims.dp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dims.fsdp_enabled

    @property
    def ddp_enabled(self) -> bool:
        return self.dims.ddp_enabled

    @property
    def fsdp_shards(self) -> int:
        """Ranks the dense weights are sharded over: dp_shard x ep (HSDP replicates over dp_replicate)."""
        return self.dp_shard * self.ep if self.fsdp_enabled else 1

    @property
    def expert_fsdp_shards(self) -> int:
        """Ranks each ep rank's experts are FSDP-sharded over: dp_shard."""
        return self.dp_shard if self.fsdp_enabled else 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def microbatch_size(self) -> int:
        """Sequences one forward takes: the local batch, split into microbatches under a pipeline."""
        return self.local_batch_size // self.microbatches if self.pp > 1 else self.local_batch_size

    @property
    def global_batch(self) -> int:
        return self.local_batch_size * self.dp

    def sequence_parallel_on(self, device_type: str) -> bool:
        if self.tp == 1:
            return False
        return self.sequence_parallel if self.sequence_parallel is not None else device_type == "cuda"

    @property
    def loss_parallel(self) -> bool:
        """Whole-model TP without PP computes the loss on vocabulary-sharded logits (Trainer.loss_parallel)."""
        return self.tp > 1 and self.pp == 1

    def describe(self) -> str:
        used = [
            f"{n}={v}"
            for n, v in (
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("ep", self.ep),
                ("tp", self.tp),
                ("pp", self.pp),
            )
            if v > 1
        ]
        if self.pp > 1:
            used.append(f"{self.pp_schedule} mb={self.microbatches}")
            if self.stages_per_rank > 1:
                used.append(f"v={self.stages_per_rank}")
        used.append(f"ac={self.activation_checkpoint} lbs={self.local_batch_size} {self.precision}")
        return " ".join(used)

    # ---- the spec's blocks ---------------------------------------------------------------------------

    @classmethod
    def from_run_config(cls, cfg: RunConfig, world: int | None = None, device_type: str = "cuda") -> Layout:
        """The layout a spec's parallelism and train blocks name, degrees of -1 resolved for `world`
        (default: their product, when none is -1); `device_type` resolves mixed_precision auto."""
        par, tr = cfg.parallelism, cfg.train
        degrees = par.named_degrees()
        if world is None:
            if -1 in degrees.values():
                inferred = next(n for n, v in degrees.items() if v == -1)
                raise SpecError(
                    f"parallelism.{inferred}=-1 is inferred from the world size: give the number of nodes "
                    "(or set every degree)"
                )
            world = 1
            for v in degrees.values():
                world *= v
        try:
            degrees = par.resolve(world)
        except ValueError as exc:
            raise SpecError(f"parallelism: {exc}") from None
        if problem := par.pipeline_problem(degrees["pp"]):
            raise SpecError(f"parallelism: {problem}")
        precision = resolve_mixed_precision(tr.mixed_precision, device_type)
        return cls(
            dp_replicate=degrees["dp_replicate"],
            dp_shard=degrees["dp_shard"],
            tp=degrees["tp"],
            pp=degrees["pp"],
            ep=degrees["ep"],
            pp_schedule=par.pp_schedule,
            microbatches=par.microbatches,
            stages_per_rank=par.stages_per_rank,
            activation_checkpoint=tr.activation_checkpoint,
            local_batch_size=tr.local_batch_size,
            precision=precision,  # type: ignore[arg-type]
            sequence_parallel=par.sequence_parallel,
        )

    def parallelism_fields(self) -> dict[str, Any]:
        """The spec's parallelism block for this layout (only what differs from the defaults beyond degrees)."""
        block: dict[str, Any] = {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "ep": self.ep,
            "tp": self.tp,
            "pp": self.pp,
        }
        if self.pp > 1:
            block |= {"pp_schedule": self.pp_schedule, "microbatches": self.microbatches}
            if self.stages_per_rank > 1 or self.pp_schedule in MULTI_STAGE_SCHEDULES:
                block["stages_per_rank"] = self.stages_per_rank
        if self.sequence_parallel is not None and self.tp > 1:
            block["sequence_parallel"] = self.sequence_parallel
        return block

    def to_parallelism(self) -> ParallelismSpec:
        """The spec's ParallelismSpec; SpecError with the validator's own message when the runtime refuses it."""
        try:
            return ParallelismSpec(**self.parallelism_fields())
        except ValidationError as exc:
            first = exc.errors()[0]
            raise SpecError(f"parallelism: {first['msg'].removeprefix('Value error, ')}") from None

    def train_fields(self) -> dict[str, Any]:
        """The spec's train-block fields this layout sets (TrainSpec)."""
        return {
            "local_batch_size": self.local_batch_size,
            "activation_checkpoint": self.activation_checkpoint,
            "mixed_precision": self.precision,
        }
