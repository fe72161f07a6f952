"""`tsm.init` and `tsm.state`: SMP v2's configuration read once, and the mesh built from it.

SMP v2 lays the world out as data parallel (hybrid shard groups, expert parallel borrowing from them) x tensor
parallel, tp innermost. hpkit's runtime mesh (hpkit.runtime.parallel.parallel_dims) is that layout: dp_replicate x
dp_shard x ep x tp, where a hybrid shard group of H ranks is dp_shard x ep. Building the same mesh lets the
script's FSDP, the transform's TP plans and the experts' all-to-all use the runtime's sub-meshes.
"""

from __future__ import annotations

import json
import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hpkit import json_text, smp_params
from hpkit.compat.smp.unsupported import SmpExit
from hpkit.runtime.parallel.parallel_dims import MeshCoords, ParallelDims, make_mesh

# What the rendered job exports (the spec's smp_parameters as JSON); SageMaker's own variable is read too.
CONFIG_ENV = "HPKIT_SMP_V2_CONFIG"
SAGEMAKER_ENV = "SM_HP_MP_PARAMETERS"


def bad_config(line: str, where: str = "tsm.init") -> SmpExit:
    """One line that ends every rank alike (each evaluates the same settings), with no collective."""
    return SmpExit(f"{where}: {line}")


@dataclass(frozen=True)
class SmpV2Config:
    hybrid_shard_degree: int = 0
    tensor_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    context_parallel_degree: int = 1
    sm_activation_offloading: bool = False
    activation_loading_horizon: int = 2
    random_seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, params: dict[str, Any]) -> SmpV2Config:
        if lines := smp_params.v2_problems(params):
            raise bad_config(lines[0])
        known = {k: v for k, v in params.items() if k in cls.__dataclass_fields__ and k != "extra"}
        return cls(**known, extra={k: v for k, v in params.items() if k not in known})


def read_config(config: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """A dict as given; a path to a JSON file; None: the job's environment, else no parameters."""
    if isinstance(config, dict):
        return dict(config)
    source = "tsm.init(config)"
    if config is None:
        text = os.environ.get(CONFIG_ENV) or os.environ.get(SAGEMAKER_ENV)
        if not text:
            return {}
        source = CONFIG_ENV if os.environ.get(CONFIG_ENV) else SAGEMAKER_ENV
        if not text.lstrip().startswith("{"):
            config = text  # a path
    if config is not None:
        path = Path(config)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise bad_config(f"cannot read the SMP config {path}: {exc.strerror}") from None
        source = str(path)
    try:
        loaded = json_text.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_config(f"{source} is not JSON ({exc.msg} at line {exc.lineno}): fix the file") from None
    if not isinstance(loaded, dict):
        raise bad_config(f"{source} must hold a JSON object of SMP parameters")
    return loaded


class Ranker:
    """SMP's rank arithmetic: the replica (hybrid shard group copy) a rank is in, and who shares it."""

    def __init__(self, coords: MeshCoords) -> None:
        self._coords = coords
        dims = coords.dims
        self._per_replica = dims.world_size // dims.dp_replicate

    def get_rep_rank(self, global_rank: int | None = None) -> int:
        rank = dist.get_rank() if global_rank is None else global_rank
        return rank // self._per_replica

    def get_rep_groups(self) -> list[list[int]]:
        """The ranks of each replica."""
        n = self._per_replica
        return [list(range(r * n, (r + 1) * n)) for r in range(self._coords.dims.dp_replicate)]

    def get_dp_rank(self) -> int:
        return self._coords.dp_rank

    def get_dp_size(self) -> int:
        return self._coords.dims.dp


class _RngTracker:
    """SMP's RNG tracker: here every rank draws from torch's own generator, so forking changes nothing."""

    @contextmanager
    def fork(self, *_args: Any, **_kwargs: Any):
        yield


@dataclass
class State:
    config: SmpV2Config
    coords: MeshCoords
    device: torch.device
    ranker: Ranker
    initialized: bool = True

    # The names scripts read.
    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def tp_size(self) -> int:
        return self.coords.dims.tp

    tensor_parallel_degree = tp_size

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def tp_process_group(self) -> dist.ProcessGroup | None:
        mesh = self.coords.tp_mesh
        return mesh.get_group() if mesh is not None else _single_group()

    @property
    def hybrid_shard_degree(self) -> int:
        return self.coords.dims.dp_shard * self.coords.dims.ep

    @property
    def expert_parallel_degree(self) -> int:
        return self.coords.dims.ep

    ep_size = expert_parallel_degree

    @property
    def ep_rank(self) -> int:
        return self.coords.local_rank_in("ep")

    @property
    def ep_process_group(self) -> dist.ProcessGroup | None:
        mesh = self.coords.ep_mesh
        return mesh.get_group() if mesh is not None else _single_group()

    @property
    def cp_size(self) -> int:
        return 1

    @property
    def cp_rank(self) -> int:
        return 0

    @property
    def cp_process_group(self) -> dist.ProcessGroup | None:
        return _single_group()

    @property
    def dp_size(self) -> int:
        return self.coords.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def world_process_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    @property
    def sm_activation_offloading(self) -> bool:
        return self.config.sm_activation_offloading

    @property
    def activation_loading_horizon(self) -> int:
        return self.config.activation_loading_horizon

    def get_rng_state_tracker(self) -> _RngTracker:
        return _RngTracker()


_single: dict[int, dist.ProcessGroup] = {}


def _single_group() -> dist.ProcessGroup:
    """A group of this rank alone (cp and tp of size 1), created by every rank alike and only once."""
    if not _single:
        for r in range(dist.get_world_size()):
            group = dist.new_group([r])
            if r == dist.get_rank():
                _single[0] = group
    return _single[0]


class _Uninitialised:
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise bad_config(f"tsm.state.{name} was read before tsm.init(): call tsm.init() first")


_state: State | None = None


def current() -> State | None:
    return _state


def require() -> State:
    if _state is None:
        init()
    assert _state is not None
    return _state


def _dims(config: SmpV2Config, world: int) -> ParallelDims:
    tp, ep = config.tensor_parallel_degree or 1, config.expert_parallel_degree or 1
    if config.context_parallel_degree not in (0, 1):
        raise bad_config(smp_params.SMP_V2_PARAMETERS["context_parallel_degree"].advice)
    if world % tp:
        raise bad_config(
            f"tensor_parallel_degree={tp} does not divide the world size {world}: use a divisor of {world}"
        )
    dp = world // tp
    shard = config.hybrid_shard_degree or dp
    if dp % shard:
        raise bad_config(
            f"hybrid_shard_degree={shard} does not divide the {dp} data-parallel ranks (world {world} / "
            f"tensor_parallel_degree {tp}): use a divisor of {dp}"
        )
    if shard % ep:
        raise bad_config(
            f"expert_parallel_degree={ep} must divide hybrid_shard_degree={shard}: expert parallel borrows its "
            "ranks from the shard group"
        )
    return ParallelDims(dp_replicate=dp // shard, dp_shard=shard // ep, tp=tp, pp=1, world_size=world, ep=ep)


def _make_mesh(dims: ParallelDims, device_type: str) -> MeshCoords:
    """The runtime's mesh, always with a dp_shard dimension: the script wraps the model in FSDP even where
    nothing is sharded (tensor parallel over the whole world), and FSDP2 needs a data-parallel mesh beside tp."""
    if dims.fsdp_enabled or ("dp_shard", 1) in dims.mesh_dims():
        return make_mesh(dims, device_type)
    sizes = [(n, size) for n, size in dims.mesh_dims() if size > 1]
    at = 1 if sizes and sizes[0][0] == "dp_replicate" else 0
    sizes.insert(at, ("dp_shard", 1))
    mesh = init_device_mesh(
        device_type, tuple(s for _, s in sizes), mesh_dim_names=tuple(n for n, _ in sizes)
    )
    return MeshCoords(mesh=mesh, dims=dims, names=tuple(n for n, _ in sizes))


def init(config: dict[str, Any] | str | os.PathLike | None = None) -> State:
    """SMP v2's `tsm.init`: read the parameters, start the process group if the script has not, build the mesh."""
    global _state
    params = SmpV2Config.parse(read_config(config))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    world = dist.get_world_size()
    dims = _dims(params, world)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    coords = _make_mesh(dims, device.type)
    if params.random_seed is not None:
        random.seed(params.random_seed)
        torch.manual_seed(params.random_seed)
    _state = State(config=params, coords=coords, device=device, ranker=Ranker(coords))
    for name, value in params.extra.items():
        known = smp_params.v2_lookup(name)
        if known is not None and known.status == "ignored" and dist.get_rank() == 0:
            print(f"tsm: warning: {name}={value!r} is ignored: {known.advice}", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        from hpkit.compat.smp_v2 import te_fallback

        te_fallback.announce()
        print(f"tsm: hpkit's SMP v2 layer: {dims.describe()} over {world} ranks", file=sys.stderr, flush=True)
    return _state


class StateProxy:
    """`tsm.state`: reads through to the state `tsm.init` built (SMP's state object is a module global too)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if _state is None:
            return getattr(_Uninitialised(), name)
        return getattr(_state, name)
