"""SageMaker model parallel (SMP v1) parameters: what hpkit does with each, in one table.

Read by the estimator importer (hpkit.sagemaker.convert), the shim's `smp.init` (hpkit.compat.smp), and
the training configuration's SMP-named degrees (hpkit.runtime.config), so that a parameter gets the same
answer everywhere: an imported spec never carries what `smp.init` would then refuse. Torch-free.

Each parameter is
- supported: `smp.init` honours it (`maps_to` names the job spec's field where there is one);
- ignored: it changes nothing that matters on hpkit's runtime; a warning says why;
- refused: hpkit has no honest equivalent; a value other than `off` stops the job (and the import) with
  the torch-native way to get what it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["supported", "ignored", "refused"]


@dataclass(frozen=True)
class SmpParameter:
    name: str
    status: Status
    advice: str  # supported: what hpkit does; ignored: why it changes nothing; refused: what to use instead
    maps_to: str | None = None  # the job spec field a supported parameter becomes
    # A refused parameter set to this value asks for what hpkit does anyway, so it passes.
    accepted: Any = False

    def refuses(self, value: Any) -> bool:
        """Whether `value` asks for something hpkit does not do (False, 0 and None turn a feature off)."""
        if self.status != "refused":
            return False
        if value == self.accepted or value is None:
            return False
        return not (self.accepted is False and value in (False, 0))


_PARAMETERS = (
    SmpParameter("tensor_parallel_degree", "supported", "tensor parallel over tp ranks", "parallelism.tp"),
    SmpParameter("pipeline_parallel_degree", "supported", "pipeline stages", "parallelism.pp"),
    SmpParameter("partitions", "supported", "pipeline stages (pipeline_parallel_degree)", "parallelism.pp"),
    SmpParameter("microbatches", "supported", "microbatches per step", "parallelism.microbatches"),
    SmpParameter(
        "ddp", "supported", "data parallel over the ranks tp and pp leave", "parallelism.dp_replicate"
    ),
    SmpParameter("pipeline", "supported", "simple: GPipe; interleaved: 1F1B", "parallelism.pp_schedule"),
    SmpParameter(
        "bf16",
        "supported",
        "the model's forward runs under torch.autocast(bfloat16), as SMP's bf16 model does",
        "train.mixed_precision",
    ),
    SmpParameter(
        "prescaled_batch",
        "refused",
        "tensor-parallel ranks here always read the same batch (prescaled_batch: true); set it to true, or "
        "drop it, and give each tensor-parallel group one batch",
        accepted=True,
    ),
    SmpParameter(
        "fp16",
        "refused",
        "drop fp16 (loss-scaled fp16) and use bf16: torch.autocast('cuda', dtype=torch.bfloat16) needs no loss scaling",
    ),
    SmpParameter("fp16_params", "refused", "drop it and use bf16 through torch.autocast"),
    SmpParameter(
        "shard_optimizer_state",
        "refused",
        "use FSDP2 (torch.distributed.fsdp.fully_shard), which shards optimizer state: hpkit train does with "
        "parallelism.dp_shard",
    ),
    SmpParameter(
        "sharded_data_parallel_degree",
        "refused",
        "use FSDP2 (torch.distributed.fsdp.fully_shard) or hpkit train with parallelism.dp_shard",
    ),
    SmpParameter(
        "active_microbatches",
        "refused",
        "drop it: torch.distributed.pipelining's Schedule1F1B bounds the microbatches in flight itself",
    ),
    SmpParameter(
        "optimize",
        "refused",
        "drop it: the partition here balances parameter counts; choose speed or memory with the pipeline schedule",
    ),
    SmpParameter(
        "offload_activations", "refused", "use torch.autograd.graph.save_on_cpu() around the forward"
    ),
    SmpParameter(
        "activation_loading_horizon", "refused", "use torch.autograd.graph.save_on_cpu() around the forward"
    ),
    SmpParameter(
        "delayed_parameter_initialization",
        "refused",
        "build the model on the meta device and call to_empty() + init after parallelising",
    ),
    SmpParameter("horovod", "refused", "drop it: data parallel here is torch.distributed (ddp: true)"),
    SmpParameter(
        "auto_partition",
        "refused",
        "drop it: the model is always split automatically, balanced by parameter count",
    ),
    SmpParameter(
        "default_partition",
        "refused",
        "drop it: the model is always split automatically, balanced by parameter count",
    ),
    SmpParameter(
        "placement_strategy",
        "ignored",
        "the mesh is always (pp, dp, tp) with tp innermost, so tensor-parallel ranks are neighbours",
    ),
    SmpParameter("contiguous", "ignored", "stages are always contiguous runs of modules"),
    SmpParameter("memory_weight", "ignored", "the partition balances parameter counts"),
    SmpParameter("ddp_port", "ignored", "the process group uses the job's rendezvous"),
    SmpParameter("ddp_dist_backend", "ignored", "the backend is nccl on CUDA and gloo on CPU"),
    SmpParameter(
        "tensor_parallel_seed",
        "ignored",
        "every rank builds the model from the same seed; shards are cut from that",
    ),
    SmpParameter(
        "skip_tracing",
        "ignored",
        "hpkit traces the model with torch.fx without running it, so there is no tracing run to skip",
    ),
)

SMP_PARAMETERS: dict[str, SmpParameter] = {p.name: p for p in _PARAMETERS}
SUPPORTED = frozenset(p.name for p in _PARAMETERS if p.status == "supported")
# SMP's pipeline names -> hpkit's pp_schedule
SMP_PIPELINES = {"simple": "gpipe", "interleaved": "1f1b"}
# SMP's degree names that hpkit's parallelism block accepts as aliases -> its own field
DEGREE_ALIASES = {"tensor_parallel_degree": "tp", "pipeline_parallel_degree": "pp", "partitions": "pp"}


def lookup(name: str) -> SmpParameter | None:
    return SMP_PARAMETERS.get(name)


def unknown_advice(name: str) -> str:
    return f"unknown SMP parameter {name}: remove it (supported: {', '.join(sorted(SUPPORTED))})"


# SMP v2 (`torch.sagemaker`): read by the importer and the shim's tsm.init (hpkit.compat.smp_v2).

V2_DEGREES = (
    "hybrid_shard_degree",
    "tensor_parallel_degree",
    "expert_parallel_degree",
    "context_parallel_degree",
)

_V2_PARAMETERS = (
    SmpParameter(
        "hybrid_shard_degree",
        "supported",
        "FSDP2 shards over groups of this many data-parallel ranks and replicates across the groups "
        "(0: shard over all of them)",
        "parallelism.dp_shard",
    ),
    SmpParameter(
        "tensor_parallel_degree",
        "supported",
        "torch-native tensor parallel (DTensor plans) on the attention and MLP of the transformed model",
        "parallelism.tp",
    ),
    SmpParameter(
        "expert_parallel_degree",
        "supported",
        "Mixtral's experts split over this many ranks, tokens sent to them by all-to-all",
        "parallelism.ep",
    ),
    SmpParameter(
        "context_parallel_degree",
        "refused",
        "torch's context parallel (torch.distributed.tensor.experimental.context_parallel) needs its SDPA "
        "kernels on CUDA; run with context_parallel_degree 1 and shorter sequences, or hpkit train",
        accepted=1,
    ),
    SmpParameter(
        "sm_activation_offloading",
        "supported",
        "the forward's saved activations go to CPU memory (torch.autograd.graph.save_on_cpu)",
    ),
    SmpParameter(
        "activation_loading_horizon",
        "ignored",
        "torch's save_on_cpu brings each activation back when backward needs it; there is no horizon to set",
    ),
    SmpParameter(
        "allow_empty_shards",
        "ignored",
        "FSDP2 pads uneven shards itself, so a rank with an empty shard is always allowed",
    ),
    SmpParameter(
        "fsdp_cache_flush_warnings",
        "ignored",
        "FSDP2 does not flush the CUDA cache between steps, so there is nothing to warn about",
    ),
    SmpParameter("random_seed", "supported", "the seed every rank's torch generator starts from"),
    SmpParameter(
        "moe",
        "ignored",
        "MoE is configured by the MoEConfig given to tsm.transform, as in SMP",
    ),
)

SMP_V2_PARAMETERS: dict[str, SmpParameter] = {p.name: p for p in _V2_PARAMETERS}


def v2_lookup(name: str) -> SmpParameter | None:
    return SMP_V2_PARAMETERS.get(name)


def v2_unknown_advice(name: str) -> str:
    known = ", ".join(sorted(SMP_V2_PARAMETERS))
    return f"{name!r} is not an SMP v2 parameter: use one of {known}"


def v2_problems(params: dict[str, Any]) -> list[str]:
    """One line per parameter that would stop `tsm.init`: unknown names, refused values, bad degrees."""
    lines = []
    for key, value in params.items():
        known = v2_lookup(key)
        if known is None:
            lines.append(v2_unknown_advice(key))
        elif known.refuses(value):
            lines.append(f"{key}={value!r} is not supported by hpkit: {known.advice}")
        elif key in V2_DEGREES or key == "random_seed":
            # hybrid_shard_degree 0 means "shard over every data-parallel rank"; the other degrees start at 1.
            least = 0 if key in ("hybrid_shard_degree", "random_seed") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                lines.append(f"{key}={value!r} must be a whole number, {least} or more")
    return lines
