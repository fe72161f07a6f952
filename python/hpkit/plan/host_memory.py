"""Host RAM per rank and per node for in-memory checkpoints (checkpoint.memory): torch-free, so that the planner
and the runtime's start-up line compute the same figure.

A rank's checkpoint state is what a persistent checkpoint writes for it: its shard of the fp32 parameters and of
the optimizer state. Its node holds `MemoryCheckpointSpec.host_copies` copies of that size per rank (the one rule
for how many; hpkit.runtime.config). The copies may take at most HOST_RAM_SHARE of the node's RAM: the rest is
the OS's, the page cache's, the data loader's and the ranks' own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpkit import catalog
from hpkit.runtime.config import MemoryCheckpointSpec

if TYPE_CHECKING:
    from hpkit.models.llama.shape import ModelShape
    from hpkit.plan.layout import Layout
    from hpkit.plan.memory import MemoryPlan

GiB = 1024**3
HOST_RAM_SHARE = 0.8


def host_bytes_per_rank(state_bytes: int, memory: MemoryCheckpointSpec | None) -> int:
    """Host RAM one rank's in-memory checkpoints take: host_copies x its state's bytes. Without checkpoint.memory,
    what one copy set would take with the default spec (replicas 1)."""
    return (memory or MemoryCheckpointSpec()).host_copies * state_bytes


def state_bytes_per_rank(shape: ModelShape, layout: Layout) -> int:
    """The largest rank's checkpoint state: fp32 parameters and AdamW's moments and step, as hpkit.plan.memory
    counts them per rank (the pp rank with the most)."""
    from hpkit.plan.memory import predict

    return state_bytes_of(predict(shape, layout))


def state_bytes_of(plan: MemoryPlan) -> int:
    """state_bytes_per_rank of a plan already made."""
    return max(r.breakdown.params + r.breakdown.optimizer for r in plan.ranks)


@dataclass(frozen=True)
class HostMemory:
    per_rank: int  # bytes
    ranks_per_node: int
    ram_gib: int | None  # the node's, from the catalog (None: unknown)
    configured: bool  # the spec has checkpoint.memory (else: what replicas 1 would cost, judged by nobody)
    copies: int

    @property
    def per_node(self) -> int:
        return self.per_rank * self.ranks_per_node

    @property
    def budget(self) -> float | None:
        return None if self.ram_gib is None else self.ram_gib * GiB * HOST_RAM_SHARE

    @property
    def problem(self) -> str | None:
        """One line, where configured copies do not fit the share of the node's RAM they may take."""
        if not self.configured or self.budget is None or self.per_node <= self.budget:
            return None
        return (
            f"checkpoint.memory: {self.copies} in-memory copies of each rank's state need "
            f"{self.per_node / GiB:.0f} GiB of host RAM per node ({self.ranks_per_node} ranks x "
            f"{self.per_rank / GiB:.1f} GiB), more than the {HOST_RAM_SHARE:.0%} of the node's {self.ram_gib} GiB "
            "they may take: shard the state over more ranks (dp_shard), or remove checkpoint.memory"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "per_rank_gib": round(self.per_rank / GiB, 2),
            "per_node_gib": round(self.per_node / GiB, 1),
            "copies": self.copies,
            "node_ram_gib": self.ram_gib,
            "ram_share": HOST_RAM_SHARE,
            "configured": self.configured,
        }


def plan_host(
    plan: MemoryPlan, instance: str | None, ranks_per_node: int, memory: MemoryCheckpointSpec | None
) -> HostMemory:
    """The host RAM a layout's in-memory checkpoints take per rank and per node of `instance`, from its memory plan."""
    return HostMemory(
        per_rank=host_bytes_per_rank(state_bytes_of(plan), memory),
        ranks_per_node=ranks_per_node,
        ram_gib=catalog.host_memory_gib(instance),
        configured=memory is not None,
        copies=(memory or MemoryCheckpointSpec()).host_copies,
    )
