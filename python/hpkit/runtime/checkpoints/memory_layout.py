"""Where in-memory checkpoints live and who holds whose copy (torch-free: placement and restore planning are
pure functions, tested for worlds of 2 to 64 nodes without a process group).

Each node keeps its copies in node-local memory (tmpfs), one folder per node and step:

    /dev/shm/hpkit-mem-<uid>/<run key>/<node>/step-00000015/
        .metadata            DCP's metadata of the step (every node keeps one)
        __3_0.distcp         rank 3's state: its own (rank 3 runs here) or held for a partner
        ranks.json           the node of every rank when the step was saved (names the lost ones)
        complete             written last, once every rank's copy is in place on its partner

Folders are keyed by Slurm's node name, so that the nodes of a development cluster, which share one host's
/dev/shm, do not see each other's copies; a lost node's folder is simply never read again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpkit import json_text
from hpkit.runtime.checkpoints.checkpoint_record import STEP_DIR
from hpkit.runtime.watchdog.hang_board import node_local_base

ROOT_ENV = "HPKIT_MEMORY_ROOT"  # another root for the copies (tests; hosts without /dev/shm)
COMPLETE = "complete"
RANKS = "ranks.json"
METADATA = ".metadata"
_SHARD = re.compile(r"^__(\d+)_(\d+)\.distcp$")
# Folders left behind by killed jobs (a job's own copies are removed when it completes) go after this long.
LEFTOVER_S = 24 * 3600.0


def memory_root(env: Mapping[str, str] | None = None) -> Path:
    return node_local_base(env, ROOT_ENV) / f"hpkit-mem-{os.getuid()}"


def run_key(anchor: Path, job_id: str) -> str:
    """The same on every node and every restart of one job (a requeue keeps the job id); another job of the
    same spec gets another key, so it never resumes from an earlier job's copies."""
    return hashlib.sha1(f"{Path(anchor).resolve()}|{job_id}".encode()).hexdigest()[:12]


def shard_file(rank: int) -> str:
    """The one file DCP's FileSystemWriter (one thread) writes for `rank`."""
    return f"__{rank}_0.distcp"


def remove_leftovers(root: Path, keep: str, now: float | None = None) -> None:
    """Other runs' folders untouched for LEFTOVER_S: a killed job cannot remove its own."""
    now = time.time() if now is None else now
    for folder in root.glob("*"):
        try:
            old = now - folder.stat().st_mtime > LEFTOVER_S
        except OSError:
            continue
        if folder.name != keep and old:
            shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Placement


def partner_nodes(
    nodes: Sequence[str], racks: Mapping[str, str] | None = None, replicas: int = 1
) -> dict[str, list[str]]:
    """For each node, the `replicas` nodes that hold copies of its ranks' states.

    The nodes go round a ring in which neighbours sit in different racks wherever the racks allow it (racks
    taken in turn, largest first); each node's copies go to the next `replicas` nodes of the ring. Losing any
    one node leaves every state on another node; losing a rack leaves them too unless one rack holds more than
    half of the nodes, when no placement can.
    """
    unique = list(dict.fromkeys(nodes))
    if replicas < 1 or replicas >= len(unique):
        raise ValueError(
            f"replicas: {replicas} copies need at least {replicas + 1} nodes (have {len(unique)})"
        )
    ring = _interleave_racks(unique, racks or {})
    return {node: [ring[(i + k) % len(ring)] for k in range(1, replicas + 1)] for i, node in enumerate(ring)}


def _interleave_racks(nodes: list[str], racks: Mapping[str, str]) -> list[str]:
    # The nodes grouped by rack, largest rack first, fill the ring's even places and then its odd ones: a
    # rack's nodes then sit two places apart, so no two neighbours share a rack while no rack holds more
    # than half of the nodes (and none on the wrap: the last even place and place 0 are the largest rack's
    # only if it holds more than half).
    groups: dict[str, list[str]] = {}
    for node in nodes:
        groups.setdefault(racks.get(node, f"\0{node}"), []).append(node)
    ordered = [node for group in sorted(groups.values(), key=len, reverse=True) for node in group]
    places = [*range(0, len(nodes), 2), *range(1, len(nodes), 2)]
    ring = [""] * len(nodes)
    for place, node in zip(places, ordered, strict=True):
        ring[place] = node
    return ring


def holders(rank_nodes: Sequence[str], partners: Mapping[str, list[str]]) -> dict[int, list[int]]:
    """For each rank, the ranks (on its node's partner nodes) that keep a copy of its state: the rank with
    the same position among its node's ranks, so that each rank sends one copy and receives about one."""
    on_node: dict[str, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        on_node.setdefault(node, []).append(rank)
    result: dict[int, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        index = on_node[node].index(rank)
        result[rank] = [on_node[p][index % len(on_node[p])] for p in partners[node]]
    return result


# --------------------------------------------------------------------------------------------------
# What a node holds, and how a restart gets every rank's state back


@dataclass(frozen=True)
class StepHolding:
    """One complete step in one node's memory."""

    step: int
    shards: frozenset[int]  # the ranks whose state files this node holds
    has_metadata: bool
    world_size: int
    rank_nodes: tuple[str, ...]  # the node of each rank when the step was saved


def read_holdings(node_dir: Path) -> list[StepHolding]:
    """The complete steps in a node's folder, newest first."""
    found = []
    for folder in node_dir.glob("step-*"):
        m = STEP_DIR.match(folder.name)
        if not m or not (folder / COMPLETE).exists():
            continue
        try:
            saved = json_text.loads((folder / RANKS).read_text(encoding="utf-8"))
            names = os.listdir(folder)
        except (OSError, ValueError):
            continue
        shards = frozenset(int(s.group(1)) for s in map(_SHARD.match, names) if s)
        found.append(
            StepHolding(int(m.group(1)), shards, METADATA in names, len(saved), tuple(str(n) for n in saved))
        )
    return sorted(found, key=lambda h: h.step, reverse=True)


@dataclass(frozen=True)
class Transfer:
    source: int  # the rank that sends
    dest: int  # the rank that receives and writes into its node's folder
    file: str


def fallback_words(persistent: bool) -> str:
    """What a run resumes from when no in-memory step is restored: its checkpoint.dir, or, without one, nothing."""
    if persistent:
        return "resuming from checkpoint.dir instead"
    return "no checkpoint.dir to resume from (checkpoint.dir unset): training starts again from step 0"


@dataclass
class RestorePlan:
    """What every rank agrees on before any loads: the step, or why there is none."""

    step: int | None
    metadata_from: int | None = None  # a rank whose node holds the step's metadata
    lost: list[int] = field(default_factory=list)  # ranks of the newest step whose every copy is gone
    lost_step: int | None = None
    lost_nodes: list[str] = field(default_factory=list)  # where those ranks' copies were

    def line(self, live_nodes: Sequence[str] = (), persistent: bool | None = None) -> str:
        """Why no in-memory step is restored; with `persistent` (whether the run has a checkpoint.dir), also
        what the run resumes from instead."""
        if self.step is not None:
            return ""
        if persistent is not None:
            return f"{self.line(live_nodes)}; {fallback_words(persistent)}"
        if self.lost_step is None:
            live = ", ".join(dict.fromkeys(live_nodes))
            return (
                f"no in-memory checkpoint is left on the live nodes ({live}): the states of every rank were "
                "held only on nodes that are lost"
            )
        shards = ",".join(map(str, self.lost)) if len(self.lost) <= 16 else f"{len(self.lost)} ranks'"
        return (
            f"in-memory checkpoint step {self.lost_step} is incomplete: the state of rank(s) {shards} was held "
            f"only on {', '.join(self.lost_nodes)}, all lost"
        )


def choose_step(
    world_size: int, holdings: Mapping[int, Sequence[StepHolding]], rank_nodes: Sequence[str]
) -> RestorePlan:
    """The newest step that the live nodes hold whole (every rank's state and the metadata somewhere), from
    each rank's view of its node (`holdings`: rank -> its node's complete steps). When the newest step any
    node holds is not whole, the plan also names its lost ranks and the nodes that held them."""
    by_node: dict[str, tuple[int, Sequence[StepHolding]]] = {}
    for rank in sorted(holdings):
        by_node.setdefault(rank_nodes[rank], (rank, holdings[rank]))
    steps = sorted(
        {h.step for _, held in by_node.values() for h in held if h.world_size == world_size}, reverse=True
    )
    plan = RestorePlan(step=None)
    for step in steps:
        shards: set[int] = set()
        meta_rank = None
        saved_nodes: tuple[str, ...] = ()
        for rank, held in by_node.values():
            for h in held:
                if h.step == step and h.world_size == world_size:
                    shards |= h.shards
                    saved_nodes = h.rank_nodes
                    if h.has_metadata and meta_rank is None:
                        meta_rank = rank
        missing = sorted(set(range(world_size)) - shards)
        if not missing and meta_rank is not None:
            plan.step, plan.metadata_from = step, meta_rank
            return plan
        if plan.lost_step is None:
            plan.lost_step, plan.lost = step, missing
            plan.lost_nodes = sorted({saved_nodes[r] for r in missing}) if saved_nodes else []
    return plan


def plan_transfers(
    needs: Mapping[int, Sequence[str]], node_files: Mapping[str, set[str]], rank_nodes: Sequence[str]
) -> list[Transfer]:
    """Who sends which file to whom so that every rank finds what it reads in its own node's folder.

    `needs`: rank -> the files its load reads; `node_files`: node -> the files its folder holds for the step.
    Each missing file goes once to each node that lacks it (to the lowest rank there that needs it), from the
    lowest rank of a node that holds it."""
    transfers: list[Transfer] = []
    sent: set[tuple[str, str]] = set()
    first_rank = {}
    for rank, node in enumerate(rank_nodes):
        first_rank.setdefault(node, rank)
    for rank in sorted(needs):
        node = rank_nodes[rank]
        for file in sorted(needs[rank]):
            if file in node_files.get(node, set()) or (node, file) in sent:
                continue
            source_node = next(
                (
                    n
                    for n in sorted(node_files, key=lambda n: first_rank.get(n, 1 << 30))
                    if file in node_files[n] and n in first_rank
                ),
                None,
            )
            if source_node is None:
                raise ValueError(f"no live node holds {file}")
            transfers.append(Transfer(first_rank[source_node], rank, file))
            sent.add((node, file))
    return transfers
