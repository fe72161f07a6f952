"""smp.init() and the rank queries: SMP's degrees -> hpkit's ParallelDims -> one DeviceMesh.

Groups, as SMP names them:
- tp: ranks holding shards of the same layers (innermost mesh dimension, neighbours on a node);
- pp: ranks holding consecutive stages of one replica;
- mp: the tp x pp ranks that together hold one whole replica (mp_rank = pp_rank * tp_size + tp_rank);
- dp: the ranks holding the same shard of the same stage, that is the replicas kept in step by ddp.
  In SMP, dp_size() counts tensor-parallel ranks too (each tp rank reads its own batch and SMP gathers
  batches across tp), and rdp_size() is the replica group without them. Here tensor-parallel ranks
  read the same batch (SMP's prescaled_batch), so dp and rdp are the same group: world / (tp * pp).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpkit.compat.smp.unsupported import (
    IGNORED_PARAMETERS,
    bad_setting,
    stop,
    warn_ignored,
)
from hpkit.smp_params import SMP_PIPELINES, SUPPORTED, lookup, unknown_advice

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from hpkit.runtime.parallel.parallel_dims import MeshCoords

SUPPORTED_PARAMETERS = SUPPORTED
PIPELINES = SMP_PIPELINES


@dataclass(frozen=True)
class SmpConfig:
    """SMP's parameters under SMP's names, checked; degrees other than dp are given, dp is what is left."""

    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    ddp: bool = False
    schedule: str = "gpipe"
    bf16: bool = False
    ignored: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_parameters(cls, params: dict[str, Any]) -> SmpConfig:
        for name, value in params.items():
            known = lookup(name)
            if known is not None and known.refuses(value):
                stop(f"the SMP parameter {name}={value!r}", known.advice)
        unknown = sorted(name for name in params if lookup(name) is None)
        if unknown:
            bad_setting(unknown_advice(unknown[0]))
        bf16 = params.get("bf16", False)
        if not isinstance(bf16, bool):
            bad_setting(f"bf16={bf16!r} must be true or false")
        if params.get("partitions", params.get("pipeline_parallel_degree")) != params.get(
            "pipeline_parallel_degree", params.get("partitions")
        ):
            bad_setting("partitions and pipeline_parallel_degree differ: give one of them")
        pp = _degree(params, "pipeline_parallel_degree", params.get("partitions", 1))
        tp = _degree(params, "tensor_parallel_degree", 1)
        microbatches = _degree(params, "microbatches", 1)
        ddp = params.get("ddp", False)
        if not isinstance(ddp, bool):
            bad_setting(f"ddp={ddp!r} must be true or false")
        pipeline = params.get("pipeline", "interleaved")
        if pipeline not in PIPELINES:
            bad_setting(f"pipeline={pipeline!r} must be one of {', '.join(PIPELINES)}")
        ignored = {k: v for k, v in params.items() if k in IGNORED_PARAMETERS}
        return cls(tp, pp, microbatches, ddp, PIPELINES[pipeline], bf16, ignored)

    @classmethod
    def from_parallelism(cls, parallelism: Any, smp_parameters: dict[str, Any]) -> SmpConfig:
        """The job spec: smp_parameters as the estimator gave them win; else hpkit's own parallelism block."""
        if smp_parameters:
            return cls.from_parameters(dict(smp_parameters))
        params: dict[str, Any] = {
            "tensor_parallel_degree": parallelism.tp,
            "pipeline_parallel_degree": parallelism.pp,
            "microbatches": parallelism.microbatches,
            "ddp": parallelism.dp_replicate != 1 or parallelism.dp_shard != 1,
        }
        return cls.from_parameters(params)


def _degree(params: dict[str, Any], name: str, default: Any) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        bad_setting(f"{name}={value!r} must be a positive integer")
    return value


@dataclass
class _State:
    config: SmpConfig
    coords: MeshCoords
    device: torch.device
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def dp(self) -> int:
        return self.coords.dims.dp


_state: _State | None = None


def state() -> _State:
    if _state is None:
        bad_setting("smp.init() must be called before any other smp call")
    return _state


def _spec_parameters() -> dict[str, Any] | SmpConfig:
    from hpkit.errors import HpkitError
    from hpkit.runtime.config import SPEC_ENV
    from hpkit.spec import load_parts

    path = os.environ.get(SPEC_ENV)
    if not path:
        return {}
    try:
        job, run = load_parts(path)
    except HpkitError as exc:
        bad_setting(f"cannot read the job spec {SPEC_ENV}={path}: {exc}")
    return SmpConfig.from_parallelism(run.parallelism, dict(job.smp_parameters) if job is not None else {})


def check_degrees(config: SmpConfig, world_size: int) -> int:
    """The data-parallel degree; stops every rank alike when the degrees do not fit the world."""
    mp = config.tp * config.pp
    if world_size % mp:
        name = "tensor_parallel_degree" if world_size % config.tp else "pipeline_parallel_degree"
        bad_setting(
            f"{name}: tensor_parallel_degree={config.tp} x pipeline_parallel_degree={config.pp} = {mp} does "
            f"not divide the {world_size} processes; choose degrees whose product divides {world_size}"
        )
    dp = world_size // mp
    if dp > 1 and not config.ddp:
        bad_setting(
            f"ddp: tensor_parallel_degree={config.tp} x pipeline_parallel_degree={config.pp} leaves {dp} "
            f"replicas of the model on {world_size} processes; set ddp: true to keep them in step"
        )
    if config.pp > 1 and config.microbatches < config.pp:
        bad_setting(
            f"microbatches={config.microbatches} must be at least pipeline_parallel_degree={config.pp} to fill the pipeline"
        )
    return dp


def init(config: dict[str, Any] | None = None) -> None:
    """Join the job's process group and build the mesh. Degrees come from `config` (SMP's parameter
    names) when given, else from the job spec in HPKIT_SPEC, else everything is 1 (plus ddp)."""
    global _state
    if _state is not None:
        return
    if config is not None:
        cfg = SmpConfig.from_parameters(dict(config))
    else:
        found = _spec_parameters()
        cfg = found if isinstance(found, SmpConfig) else SmpConfig.from_parameters({"ddp": True})
    for name, value in cfg.ignored.items():
        warn_ignored(name, value)

    from hpkit.runtime.env import choose_device, configure_threads, init_distributed, read_launch_env
    from hpkit.runtime.parallel.parallel_dims import ParallelDims, make_mesh

    launch = read_launch_env()
    # Checked before joining the process group: every rank reaches the same verdict, none waits for another.
    dp = check_degrees(cfg, launch.world_size)
    configure_threads(launch)
    device = choose_device(launch)
    init_distributed(launch, device)
    atexit.register(_leave)
    dims = ParallelDims(dp_replicate=dp, dp_shard=1, tp=cfg.tp, pp=cfg.pp, world_size=launch.world_size)
    coords = make_mesh(dims, device.type)
    _state = _State(
        cfg,
        coords,
        device.torch_device(),
        launch.rank,
        launch.world_size,
        launch.local_rank,
        launch.local_world_size,
    )


def _leave() -> None:
    import torch.distributed as dist

    from hpkit.compat.smp.step_state import finish_sends

    if dist.is_initialized():
        finish_sends()
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _state is not None


def config() -> SmpConfig:
    return state().config


def rank() -> int:
    return state().rank


def size() -> int:
    return state().size


def local_rank() -> int:
    return state().local_rank


def local_size() -> int:
    return state().local_size


def tp_rank() -> int:
    return state().coords.tp_rank


def tp_size() -> int:
    return state().config.tp


def pp_rank() -> int:
    return state().coords.pp_rank


def pp_size() -> int:
    return state().config.pp


def dp_rank() -> int:
    return state().coords.dp_rank


def dp_size() -> int:
    return state().dp


rdp_rank = dp_rank
rdp_size = dp_size


def mp_rank() -> int:
    return pp_rank() * tp_size() + tp_rank()


def mp_size() -> int:
    return tp_size() * pp_size()


def _group(*names: str) -> ProcessGroup | None:
    coords = state().coords
    sub = coords.sub(*names)
    if sub is None:
        return None
    if sub.ndim > 1:
        sub = sub._flatten()
    return sub.get_group()


def get_tp_process_group() -> ProcessGroup | None:
    return _group("tp")


def get_pp_process_group() -> ProcessGroup | None:
    return _group("pp")


def get_dp_process_group() -> ProcessGroup | None:
    return _group("dp_replicate")


get_rdp_process_group = get_dp_process_group


def get_mp_process_group() -> ProcessGroup | None:
    return _group("pp", "tp")


def get_world_process_group() -> ProcessGroup | None:
    import torch.distributed as dist

    return dist.group.WORLD


def barrier() -> None:
    import torch.distributed as dist

    state()
    dist.barrier()
