"""Parallel degrees -> one named DeviceMesh that every parallelism takes its sub-mesh from.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, ep, tp. tp is innermost so that its ranks
are neighbours (same node), where its per-layer collectives are cheapest; ep next, since its all-to-alls
move every routed token twice per MoE block; pp is outermost because it only sends activations between
neighbouring stages. ep ranks split the batch as data-parallel ranks do: the dense weights are sharded
over dp_shard x ep (flattened as "dp_shard_ep"), the experts over dp_shard only (they are split over ep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpkit.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hpkit.runtime.config import ParallelismSpec

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1

    @classmethod
    def from_spec(cls, spec: ParallelismSpec, world_size: int) -> ParallelDims:
        try:
            degrees = spec.resolve(world_size)
        except ValueError as exc:
            raise SpecError(f"parallelism: {exc}") from None
        # A pp inferred from the world size (-1) meets the schedule's rules only now.
        if problem := spec.pipeline_problem(degrees["pp"]):
            raise SpecError(f"parallelism: {problem}")
        return cls(world_size=world_size, **degrees)

    @property
    def dp(self) -> int:
        """Ranks that read different data: the data-parallel ones and the expert-parallel ones."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def fsdp_enabled(self) -> bool:
        # With tensor, pipeline or expert parallel, replicas are kept by FSDP2 as HSDP with shard degree 1:
        # DDP cannot hold DTensors, and its bucket rebuilding breaks when a pipeline runs several
        # microbatches under no_sync (torch 2.13: "rebuilt parameter indices size is not same as original").
        return self.dp_shard * self.ep > 1 or (self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def mesh_dims(self) -> list[tuple[str, int]]:
        """The dimensions the mesh is built with: those in use, and dp_shard whenever FSDP shards over it."""
        dims = [(name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1]
        if self.fsdp_enabled and self.dp_shard == 1:
            # HSDP needs a shard dimension even when it has one rank, and so do the experts' FSDP units.
            names = [n for n, _ in dims]
            at = next((names.index(n) + 1 for n in ("dp_replicate", "pp") if n in names), 0)
            dims.insert(at, ("dp_shard", 1))
        return dims or [("dp_shard", 1)]

    def describe(self) -> str:
        used = [f"{name}={size}" for name, size in self.degrees().items() if size > 1]
        return " ".join(used) or "single process"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.mesh_dims()
        return init_device_mesh(
            device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )


@dataclass(frozen=True)
class MeshCoords:
    """This rank's place in the layout, and the sub-meshes the parallelisms use (None where unused)."""

    mesh: DeviceMesh
    dims: ParallelDims
    names: tuple[str, ...]
    dp_shard_ep: DeviceMesh | None = None  # dp_shard x ep flattened (expert parallel only)

    def _has(self, name: str) -> bool:
        return name in self.names

    def local_rank_in(self, name: str) -> int:
        return self.mesh[name].get_local_rank() if self._has(name) else 0

    @property
    def dp_rank(self) -> int:
        """This rank's slice of the batch, among dims.dp slices."""
        shard = self.local_rank_in("dp_replicate") * self.dims.dp_shard + self.local_rank_in("dp_shard")
        return shard * self.dims.ep + self.local_rank_in("ep")

    @property
    def pp_rank(self) -> int:
        return self.local_rank_in("pp")

    @property
    def tp_rank(self) -> int:
        return self.local_rank_in("tp")

    def sub(self, *names: str) -> DeviceMesh | None:
        present = tuple(n for n in names if self._has(n))
        if not present:
            return None
        return self.mesh[present] if len(present) > 1 else self.mesh[present[0]]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.sub("tp") if self.dims.tp_enabled else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.sub("pp") if self.dims.pp_enabled else None

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """dp_shard alone (FSDP) or (dp_replicate, dp_shard) (HSDP); with ep, dp_shard x ep in its place."""
        if not self.dims.fsdp_enabled:
            return None
        if not self.dims.ep_enabled:
            return self.sub("dp_replicate", "dp_shard")
        # torch deprecates slicing a flattened dimension from the root mesh: only HSDP needs to.
        return self.mesh["dp_replicate", "dp_shard_ep"] if self._has("dp_replicate") else self.dp_shard_ep

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The ranks that hold the same experts: (dp_replicate,) dp_shard."""
        return self.sub("dp_replicate", "dp_shard") if self.dims.ep_enabled else None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        return self.sub("ep") if self.dims.ep_enabled else None

    @property
    def ddp_mesh(self) -> DeviceMesh | None:
        return self.sub("dp_replicate") if self.dims.ddp_enabled else None


def make_mesh(dims: ParallelDims, device_type: str) -> MeshCoords:
    mesh = dims.build_mesh(device_type)
    names = tuple(mesh.mesh_dim_names or ())
    # The dense weights' FSDP spans the ep ranks too: one flattened dimension for them.
    flat = mesh["dp_shard", "ep"]._flatten("dp_shard_ep") if dims.ep_enabled else None
    return MeshCoords(mesh=mesh, dims=dims, names=names, dp_shard_ep=flat)
