"""The training configuration: what `hpkit train` needs from a job spec, and nothing that concerns Slurm.

Torch-free, so that the login node can validate it. `JobSpec` (hpkit.spec) holds a `RunConfig` (its `run`)
beside the Slurm job: a whole job spec has a run configuration, and a file of bare training blocks is one.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from hpkit.job_identity import JobIdentity
from hpkit.layout_rules.parallel import ep_problem
from hpkit.layout_rules.pipeline import Schedule, schedule_problem, stages_problem
from hpkit.models.families import SHAPE_NAMES, family_of
from hpkit.models.llama.shape import MAX_LAYERS, MAX_WIDTH, ModelShape, shape_named
from hpkit.smp_params import DEGREE_ALIASES
from hpkit.validation import StrictModel, check_no_control_chars

SPEC_ENV = "HPKIT_SPEC"
# resilience.warm_preload: what the zygote's --preload takes (comma-joined, so no comma or space in a name).
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", re.ASCII)
MAX_WARM_PRELOAD = 64


def _whole_number(value: Any) -> bool:
    """What the degree fields accept: an integer, or its text or float form ("2", 2.0), as pydantic's lax mode."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, str) and value.strip().lstrip("-").isdigit()


class ParallelismSpec(StrictModel):
    """Parallel degrees; their product is the world size. One degree may be -1 and is inferred.

    SageMaker model-parallel names are accepted: tensor_parallel_degree, pipeline_parallel_degree
    (or partitions), microbatches, and ddp (plain data parallel over the remaining ranks).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = Field(
        default=1,
        description=(
            "expert parallel: each MoE block's routed experts are split over ep ranks and tokens reach them by "
            "all-to-all. ep ranks also split the batch, as data parallel does, and the other weights are "
            "FSDP-sharded over dp_shard x ep; the world is dp_replicate x dp_shard x ep x tp x pp"
        ),
    )
    tp: int = 1
    pp: int = 1
    microbatches: int = Field(default=1, ge=1)
    pp_schedule: Schedule = Field(
        default="1f1b",
        description=(
            "gpipe, 1f1b: one stage per pp rank; interleaved_1f1b: stages_per_rank stages, stage i on pp rank "
            "i % pp; zero_bubble: torch's ZBVZeroBubble, 2 stages per rank in a V (rank r: stages r and 2*pp-1-r)"
        ),
    )
    stages_per_rank: int = Field(
        default=1,
        ge=1,
        description="pipeline stages each pp rank holds: 1 for gpipe and 1f1b, 1 or more for interleaved_1f1b, "
        "exactly 2 for zero_bubble",
    )
    tp_modules: list[str] | None = Field(
        default=None, description="apply tensor parallel only to these module names (None: the whole model)"
    )
    sequence_parallel: bool | None = Field(
        default=None,
        description=(
            "under whole-model tensor parallel, shard the norms and the residual stream along the sequence; "
            "unset: on CUDA, off on CPU (gloo has no reduce-scatter of its own: it runs a full all-reduce, "
            "so sequence parallel would only add all-gathers there)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _sagemaker_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for alias, canonical in DEGREE_ALIASES.items():
            if alias in data:
                value = data.pop(alias)
                if not _whole_number(value):
                    # Checked here, under the user's name for it: the field's own check would name `canonical`.
                    raise ValueError(f"{alias}: {value!r} is not a whole number (a degree: 2, 4, 8, ...)")
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
            raise ValueError("only one of dp_replicate, dp_shard, ep, tp, pp may be -1")
        if self.sequence_parallel and self.tp_modules is not None:
            raise ValueError(
                "sequence_parallel applies to whole-model tensor parallel; with tp_modules the residual stream "
                "stays whole: remove one of them"
            )
        if self.pp != -1 and (problem := self.pipeline_problem(self.pp)):
            raise ValueError(problem)
        return self

    def pipeline_problem(self, pp: int) -> str | None:
        """Why torch's pipeline schedules (2.13) cannot run these settings with `pp` ranks, or None."""
        return schedule_problem(pp, self.microbatches, self.pp_schedule, self.stages_per_rank)

    def named_degrees(self) -> dict[str, int]:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "ep": self.ep,
            "tp": self.tp,
            "pp": self.pp,
        }

    def resolve(self, world_size: int) -> dict[str, int]:
        """Degrees with -1 filled in; raises ValueError when they cannot make up world_size."""
        degrees = self.named_degrees()
        known = math.prod(v for v in degrees.values() if v != -1)
        if world_size % known:
            raise ValueError(
                f"the degrees {_fmt(degrees)} multiply to {known}, which does not divide the world size "
                f"{world_size}: make dp_replicate*dp_shard*ep*tp*pp equal {world_size}"
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


class MoESpec(StrictModel):
    """Mixture of experts: every `every`-th block's FFN becomes `experts` routed experts plus `shared_experts`
    always-on ones; each token goes to its `top_k` experts. Unset fields keep the shape's (debug-moe) or
    these defaults."""

    experts: int | None = Field(default=None, ge=2, le=MAX_WIDTH, description="routed experts per MoE block")
    top_k: int | None = Field(
        default=None, ge=1, le=MAX_WIDTH, description="experts each token goes to (default 2)"
    )
    shared_experts: int | None = Field(
        default=None, ge=0, le=MAX_WIDTH, description="experts every token goes through"
    )
    every: int | None = Field(default=None, ge=1, description="every N-th block is a MoE block (default 1)")
    aux_loss_coef: float | None = Field(
        default=None, ge=0, description="weight of the load-balancing loss (default 0.01; 0 turns it off)"
    )
    expert_ffn_dim: int | None = Field(
        default=None, ge=1, le=MAX_WIDTH, description="experts' SwiGLU hidden size"
    )

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoESpec:
        if self.experts is not None and self.top_k is not None and self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} is more than experts={self.experts}: lower top_k")
        return self


# LoRA targets by their Hugging Face (PEFT) names -> the module each names inside an hpkit block.
LORA_TARGETS = {
    "q_proj": "attention.wq",
    "k_proj": "attention.wk",
    "v_proj": "attention.wv",
    "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1",
    "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2",
}


class LoraSpec(StrictModel):
    """Low-rank adapters (LoRA, as PEFT's): each targeted projection W gains B @ A (rank `rank`), scaled by
    alpha / rank; W and every other base weight stay frozen and only A and B are trained and saved."""

    rank: int = Field(default=8, ge=1, description="the adapters' rank r")
    alpha: float = Field(default=16.0, gt=0, description="scaling numerator: B @ A is scaled by alpha / rank")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="projections to adapt, by Hugging Face name: " + ", ".join(LORA_TARGETS),
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in LORA_TARGETS:
                raise ValueError(f"{name!r} names no module: choose among {', '.join(LORA_TARGETS)}")
        if len(set(value)) != len(value):
            raise ValueError("a target is named twice: name each once")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class ModelSpec(StrictModel):
    """A model family's named shape (hpkit.models.families), optionally with some dimensions overridden, or
    the shape and weights of a Hugging Face Llama checkpoint (init_from)."""

    name: Literal[SHAPE_NAMES] = "debug"  # type: ignore[valid-type]
    init_from: str | None = Field(
        default=None,
        description="a Hugging Face Llama directory (config.json + *.safetensors): its shape and weights; "
        "a checkpoint to resume from takes precedence",
    )
    vocab_size: int | None = Field(
        default=None, ge=2, le=MAX_WIDTH, description="override the shape's vocabulary"
    )
    seq_len: int = Field(default=256, ge=2)
    dim: int | None = Field(default=None, ge=8, le=MAX_WIDTH, description="override the hidden size")
    n_layers: int | None = Field(
        default=None, ge=1, le=MAX_LAYERS, description="override the number of blocks"
    )
    n_heads: int | None = Field(
        default=None, ge=1, le=MAX_WIDTH, description="override the number of attention heads"
    )
    n_kv_heads: int | None = Field(
        default=None, ge=1, le=MAX_WIDTH, description="override the key/value heads (GQA)"
    )
    ffn_dim: int | None = Field(
        default=None, ge=1, le=MAX_WIDTH, description="override the SwiGLU hidden size"
    )
    moe: MoESpec | None = Field(default=None, description="make the model a mixture of experts (MoESpec)")
    lora: LoraSpec | None = Field(
        default=None,
        description="train low-rank adapters on a frozen base instead of every weight (LoraSpec)",
    )

    @model_validator(mode="after")
    def _init_from_sets_the_shape(self) -> ModelSpec:
        if self.init_from is None:
            return self
        check_no_control_chars(self.init_from, "init_from")
        # Given and not its default: a snapshot of the spec (spec.document()) writes every field, defaults too,
        # and must read back (its job's ranks read it).
        shaped = [
            f
            for f in ("name", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "moe")
            if f in self.model_fields_set and getattr(self, f) != type(self).model_fields[f].default
        ]
        if shaped:
            raise ValueError(
                f"{shaped[0]} cannot be given with init_from: the shape comes from {self.init_from}/config.json; "
                f"leave {shaped[0]} out"
            )
        return self

    def named_shape(self) -> ModelShape:
        """The named shape with this block's overrides, moe merged onto the shape's own (or the defaults): what
        the runtime's adapters build and the planner plans. SpecError naming the field when it makes no model."""
        return shape_named(
            self.name,
            self.seq_len,
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            moe=self.moe.model_dump() if self.moe is not None else None,
        )


class DataSpec(StrictModel):
    kind: Literal["synthetic", "tokens", "prepared"] = "synthetic"
    path: str | None = Field(
        default=None,
        description=(
            "kind tokens: a flat binary file of token ids; kind prepared: a directory from `hpkit data prepare` "
            "(with --format chat: rows of model.seq_len+1 tokens and their loss mask)"
        ),
    )
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="kind tokens only (a prepared directory's index names its own)"
    )

    @model_validator(mode="after")
    def _path(self) -> DataSpec:
        if self.kind == "tokens" and not self.path:
            raise ValueError("kind: tokens needs path: the token file to read")
        if self.kind == "prepared" and not self.path:
            raise ValueError("kind: prepared needs path: the directory `hpkit data prepare` wrote")
        return self


class EvalSpec(StrictModel):
    """Validation: the masked loss and perplexity on a held-out set, every `every` steps (or once, `only`).

    The loss is the mean over every counted token of the set (labels other than IGNORE_INDEX), summed and
    counted over all data-parallel ranks, never a mean of per-batch means. The set is read in batches of
    train.local_batch_size samples, batch b going to data-parallel rank b % dp; a rank left without a batch
    runs an empty one (no counted token) so that every collective of the layout still meets.
    """

    every: int | None = Field(
        default=None, description="validate after every N-th step (and after the last); unset with only: true"
    )
    steps: int | None = Field(
        default=None,
        description="validate on at most this many rounds of batches (one batch per data-parallel rank each); "
        "unset: the whole set (a synthetic set has no end: give steps)",
    )
    data: DataSpec | None = Field(
        default=None, description="the held-out set (a DataSpec: kind, path, dtype)"
    )
    only: bool = Field(
        default=False,
        description="validate the checkpoint a resume finds (or model.init_from's weights) once, without training",
    )

    @field_validator("every", "steps")
    @classmethod
    def _positive(cls, value: int | None, info: Any) -> int | None:
        if value is not None and value < 1:
            what = (
                "validate every N steps" if info.field_name == "every" else "validate on N rounds of batches"
            )
            raise ValueError(f"{value} is not a positive number: {what} with N >= 1, or leave it out")
        return value

    @model_validator(mode="after")
    def _complete(self) -> EvalSpec:
        if self.data is None:
            raise ValueError(
                "data is missing: name the held-out set, e.g. data: {kind: prepared, path: DIR} "
                "(or kind: tokens, path: FILE)"
            )
        if self.every is None and not self.only:
            raise ValueError("every is missing: validate every N steps (every: N), or set only: true")
        if self.data.kind == "synthetic" and self.steps is None:
            raise ValueError(
                "steps is missing: a synthetic held-out set has no end: give steps: N rounds of batches"
            )
        return self


class StragglerSpec(StrictModel):
    """Find a rank that drags the job: compare each rank's own work time with the others' every few steps.

    Every `every_steps` steps the ranks exchange their mean local work time over that window (one small
    all-gather on a CPU group, started without waiting and read a step later). A rank slower than the
    median of the others by `factor` in `windows` windows in a row is named once in a warning.
    """

    enabled: bool = True
    every_steps: int = Field(default=20, ge=1, description="steps in one window (one all-gather per window)")
    factor: float = Field(default=1.5, gt=1, description="how many times slower than the others' median")
    windows: int = Field(default=3, ge=1, description="consecutive slow windows before the warning")
    link_probe_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "also time each node's links every window: the first rank of each node sends this many bytes to the "
            "next node's around a ring, three times, the fastest counted (on the CPU group: TCP, not the GPUs' "
            "fabric); a node whose links are all slow is named. 0: off. Needs three nodes"
        ),
    )


class PrometheusSpec(StrictModel):
    """Training metrics for Prometheus through prometheus-client: a textfile for node_exporter, or HTTP."""

    textfile_dir: str | None = Field(
        default=None,
        description="node_exporter's textfile-collector directory; each rank writes <name>-<job>-rank<r>.prom there",
    )
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="serve /metrics over HTTP; local rank r listens on port + r",
    )

    @field_validator("textfile_dir")
    @classmethod
    def _dir(cls, value: str | None) -> str | None:
        if value is not None:
            check_no_control_chars(value, "textfile_dir")
            if not value.strip():
                raise ValueError("textfile_dir is empty: name the directory node_exporter reads")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> PrometheusSpec:
        if (self.textfile_dir is None) == (self.port is None):
            raise ValueError(
                "give exactly one of textfile_dir (a directory node_exporter reads) or port (an HTTP endpoint)"
            )
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
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    prometheus: PrometheusSpec | None = Field(
        default=None, description="also export the metrics to Prometheus (None: do not)"
    )
    data: DataSpec = Field(default_factory=DataSpec)

    @field_validator("metrics_file")
    @classmethod
    def _inside_output_dir(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_no_control_chars(value, "metrics_file")
        if posixpath.isabs(value):
            return posixpath.normpath(value)
        normal = posixpath.normpath(value)
        if normal == ".." or normal.startswith("../") or normal == ".":
            raise ValueError(
                f"{value!r} is not a file inside output_dir: name one there, or give an absolute path"
            )
        return normal


# `checkpoint.memory.every: auto`: the share of training time a save may block (issue 44's target for the copy).
AUTO_EVERY_BUDGET = 0.05


class MemoryCheckpointSpec(StrictModel):
    """In-memory checkpoints (hpkit.runtime.checkpoints.memory_checkpoint): each rank's state staged to host RAM every `every`
    steps, with a copy on a partner node, so that a restart after a lost node or rank reads nothing from
    `checkpoint.dir` and redoes at most `every` steps."""

    every: int | Literal["auto"] = Field(
        default="auto",
        description="save every this many steps (1: every step); auto: from a measured save (and again over its "
        f"first interval), the fewest steps that keep what a save costs training within {AUTO_EVERY_BUDGET:.0%} of "
        "the steps between saves and give its write to node memory time to finish before the next",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1,
        description="copies of each rank's state on other nodes (1: one partner node, so any one lost node is recovered)",
    )

    @field_validator("every", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        # One message for both halves of the union (pydantic would give one per half).
        if isinstance(value, bool) or value == "auto":
            return value  # a bool is refused as a bool, by StrictModel
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ValueError(f"{value!r} is neither a number of steps nor auto")
        if value < 1:
            raise ValueError(f"{value} is not a number of steps: save every N steps with N >= 1, or auto")
        return value

    @property
    def host_copies(self) -> int:
        """How many copies of a rank's checkpoint state its node's RAM holds at the peak, per rank: the staging
        copy, then two generations (the newest complete one is kept while the next is written) of the rank's
        own state and of the `replicas` partners' states it holds. The planner multiplies this by the state's
        bytes per rank; the runtime's start-up line shows the same product."""
        return 1 + 2 * (1 + self.replicas)


class CheckpointSpec(StrictModel):
    memory: MemoryCheckpointSpec | None = Field(
        default=None,
        description="in-memory checkpoints in host RAM with partner copies (None: persistent checkpoints only)",
    )
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


class HangSpec(StrictModel):
    """The hang watchdog (hpkit.runtime.watchdog.hang_watchdog): a job whose ranks stop finishing steps is stopped in
    seconds, with the culprit named and every rank's stacks on disk, instead of waiting out the collective
    timeout."""

    enabled: bool = Field(default=True, description="run the watchdog thread in every rank")
    min_s: float = Field(
        default=60.0,
        ge=2,
        description=(
            "never call a hang before this many seconds without a finished step: above a data loader's or an "
            "evaluation's pause, and ten times below the default collective timeout"
        ),
    )
    factor: float = Field(
        default=10.0,
        ge=2,
        description="and not before this many median step times (long steps get a longer limit)",
    )
    start_s: float = Field(
        default=600.0,
        ge=10,
        description="the start-up load and first step may take this long before the watchdog judges them",
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
    hang: HangSpec = Field(default_factory=HangSpec)
    spare_nodes: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "allocate this many nodes beyond `nodes`: when a node is lost or found bad (a hang's culprit, a "
            "node that no longer starts a task) the next attempt runs on the others plus a spare, inside "
            "the same job, from the last checkpoint (counted against max_restarts)"
        ),
    )
    replace_bad_nodes: bool = Field(
        default=False,
        description=(
            "on SageMaker HyperPod, also ask for a bad node's replacement (scontrol update node=NODE "
            'state=fail reason="Action:Replace")'
        ),
    )
    warm_start: bool | None = Field(
        default=None,
        description=(
            "fork each rank from a per-node process of the job that has already imported torch and hpkit "
            "(hpkit.warm), spares included: every step, a restarted one or a swapped-in spare's too, skips the "
            "interpreter's start and its imports; needs a Python command (python SCRIPT or python -m MODULE), and no "
            "container or Slurm's own (container.runtime: oci, Slurm 24.11 or later). Left out: on where it can be, "
            "for a job without GPUs (gpus_per_node: 0) outside a container; set true to have it on GPU nodes or in "
            "an OCI container"
        ),
    )
    warm_preload: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_WARM_PRELOAD,
        description=(
            "more modules the warm process imports before it forks ranks (warm_start), such as "
            "transformers.models.llama.modeling_llama for a script built on Hugging Face models: every rank, a "
            "restarted one or a spare's too, finds them imported. A module that cannot be imported there is named "
            "in the job's log, and the ranks import it themselves"
        ),
    )
    keep_survivors: bool | None = Field(
        default=None,
        description=(
            "with warm starts, a rank whose process group breaks (a peer lost) leaves the group and stays in its "
            "process instead of ending; the next step on its node takes that process over (hpkit.warm.park), "
            "keeping its imports, a GPU's context and compiled kernels. A rank blocked in a collective that "
            "cannot be interrupted (a cut link under gloo) is restarted as without it. Left out: on where the "
            "ranks of `hpkit train` start warm on CPUs (gloo, where a lost peer closes its sockets); set true to "
            "have it on GPU nodes (NCCL's communicator abort, not yet run on a GPU), false to end survivors"
        ),
    )
    requeue_on_failure: bool | None = Field(
        default=None,
        description=(
            "when a node of the job dies, let Slurm requeue the job, counted against max_restarts "
            "(default: on when max_restarts > 0); a program that fails on healthy nodes is never requeued"
        ),
    )

    @field_validator("warm_preload")
    @classmethod
    def _module_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not MODULE_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a module name: dotted Python names, such as "
                    "transformers.models.llama.modeling_llama"
                )
        return names

    @model_validator(mode="after")
    def _requeue_needs_a_budget(self) -> ResilienceSpec:
        if self.requeue_on_failure and self.max_restarts == 0:
            raise ValueError(
                "requeue_on_failure: true needs a restart budget: set max_restarts > 0, "
                "or drop requeue_on_failure"
            )
        if self.spare_nodes and self.max_restarts == 0:
            raise ValueError(
                f"spare_nodes: {self.spare_nodes} needs a restart budget to use them: set max_restarts > 0, "
                "or drop spare_nodes"
            )
        return self

    def survivors_stay(self, on_gpus: bool) -> bool:
        """Whether a warm `hpkit train` rank whose group broke stays in its process (keep_survivors, or its
        default): the one rule the spec (for the supervisor) and the rank itself both ask."""
        if self.keep_survivors is None:
            return not on_gpus
        return self.keep_survivors

    def requeues_on_failure(self) -> bool:
        """Whether Slurm may requeue the job after a node failure (the field, or its default)."""
        if self.requeue_on_failure is None:
            return self.max_restarts > 0
        return self.requeue_on_failure


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


class RunConfig(JobIdentity):
    """The training blocks of a job spec; also a file of its own (`hpkit train --config`), where `name`
    may be left out."""

    document_shape: ClassVar[str] = "a training config is a mapping of keys"
    document_source: ClassVar[str] = "config"
    default_name: ClassVar[str | None] = "train"

    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    eval: EvalSpec | None = Field(
        default=None, description="validation on a held-out set (EvalSpec; None: none)"
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    collectives: CollectivesSpec = Field(default_factory=CollectivesSpec)

    @model_validator(mode="after")
    def _experts_fit(self) -> RunConfig:
        ep, moe = self.parallelism.ep, self.model.moe
        if ep in (1, -1):
            return self
        # With init_from the family is config.json's (a Mixtral is a MoE): the trainer checks it there.
        if moe is None and self.model.init_from is None and family_of(self.model.name) != "moe":
            raise ValueError(
                f"parallelism.ep={ep} splits a mixture of experts, but model {self.model.name} is dense: "
                "set model.moe (experts: ...) or a MoE shape such as name: debug-moe, or ep: 1"
            )
        if self.train.activation_checkpoint == "selective":
            # Selective checkpointing replays the block's recorded ops in backward and needs the same op
            # sequence; the experts' all-to-alls (and their split sizes) break that replay (torch 2.13).
            raise ValueError(
                f"train.activation_checkpoint selective with parallelism.ep={ep}: the experts' all-to-all "
                "cannot be replayed by selective checkpointing: use activation_checkpoint: full or none"
            )
        if moe is not None and moe.experts is not None and (problem := ep_problem(ep, moe.experts)):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _eval_only_has_weights(self) -> RunConfig:
        if (
            self.eval is not None
            and self.eval.only
            and self.checkpoint.dir is None
            and self.model.init_from is None
        ):
            raise ValueError(
                "eval.only: true validates trained weights, but there are none to load: set checkpoint.dir "
                "(its newest checkpoint) or model.init_from"
            )
        return self

    @model_validator(mode="after")
    def _pipeline_fits_the_model(self) -> RunConfig:
        par, tr = self.parallelism, self.train
        if par.pp == 1:
            return self
        # Without n_layers the shape's block count is known only to the trainer, which checks it there.
        if (
            par.pp > 1
            and self.model.n_layers is not None
            and (problem := stages_problem(par.pp, par.stages_per_rank, self.model.n_layers))
        ):
            raise ValueError(problem)
        if par.pp_schedule == "zero_bubble":
            # Zero bubble splits each backward in two (inputs, then weights), which torch 2.13 refuses for
            # compiled stages and selective checkpointing cannot do (it allows one backward per region).
            if tr.compile:
                raise ValueError(
                    "train.compile with parallelism.pp_schedule zero_bubble: torch runs no compiled stage under "
                    "zero bubble: set compile: false, or pp_schedule: interleaved_1f1b"
                )
            if tr.activation_checkpoint == "selective":
                raise ValueError(
                    "train.activation_checkpoint selective with parallelism.pp_schedule zero_bubble: its split "
                    "backward runs twice through each checkpointed block, which selective checkpointing refuses: "
                    "use activation_checkpoint: full or none, or pp_schedule: interleaved_1f1b"
                )
        return self


def resolve_mixed_precision(setting: str, device_type: str) -> str:
    if setting == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return setting
