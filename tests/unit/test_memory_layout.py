"""In-memory checkpoints: partner placement and the restore plan (hpkit.runtime.checkpoints.memory_layout, torch-free)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from hpkit.runtime.checkpoints.checkpoint_record import step_dir_name
from hpkit.runtime.checkpoints.memory_layout import (
    COMPLETE,
    METADATA,
    RANKS,
    StepHolding,
    choose_step,
    holders,
    partner_nodes,
    plan_transfers,
    read_holdings,
    shard_file,
)


def _rank_nodes(nodes: list[str], per_node: int) -> list[str]:
    return [node for node in nodes for _ in range(per_node)]


def _survivors(rank_nodes: list[str], held_by: dict[int, list[int]], lost: set[str]) -> set[int]:
    """The ranks whose state is still on some node after `lost` go: its own node, or a holder's."""
    return {
        rank
        for rank, node in enumerate(rank_nodes)
        if node not in lost or any(rank_nodes[h] not in lost for h in held_by[rank])
    }


@pytest.mark.parametrize("per_node", [1, 2, 8])
def test_losing_any_one_node_leaves_a_copy_of_every_rank_for_2_to_64_nodes(per_node):
    for count in range(2, 65):
        nodes = [f"node{i}" for i in range(1, count + 1)]
        rank_nodes = _rank_nodes(nodes, per_node)
        held_by = holders(rank_nodes, partner_nodes(nodes))
        for rank, node in enumerate(rank_nodes):
            assert all(rank_nodes[h] != node for h in held_by[rank]), (count, rank)
        for lost in nodes:
            assert _survivors(rank_nodes, held_by, {lost}) == set(range(len(rank_nodes))), (count, lost)
        # Each rank holds about one other rank's copy: the copies spread over the world.
        assert max(Counter(h for hs in held_by.values() for h in hs).values()) == 1, count


def test_losing_any_one_rack_leaves_a_copy_where_no_rack_holds_more_than_half():
    rng = random.Random(7)
    for count in range(2, 65):
        for _ in range(20):
            racks_n = rng.randint(2, max(2, count // 2 + 1))
            nodes = [f"n{i}" for i in range(count)]
            racks = {n: f"rack{rng.randrange(racks_n)}" for n in nodes}
            if max(Counter(racks.values()).values()) * 2 > count:
                continue  # no placement can survive the loss of a rack holding more than half
            partners = partner_nodes(nodes, racks)
            rank_nodes = _rank_nodes(nodes, 2)
            held_by = holders(rank_nodes, partners)
            for rack in set(racks.values()):
                lost = {n for n in nodes if racks[n] == rack}
                assert _survivors(rank_nodes, held_by, lost) == set(range(len(rank_nodes))), (racks, rack)


def test_two_partner_nodes_lost_together_lose_states():
    nodes = ["a", "b", "c"]
    rank_nodes = _rank_nodes(nodes, 1)
    partners = partner_nodes(nodes)
    held_by = holders(rank_nodes, partners)
    lost = {"a", partners["a"][0]}
    assert _survivors(rank_nodes, held_by, lost) != set(range(3))


def test_replicas_need_more_nodes_than_copies():
    with pytest.raises(ValueError, match="replicas: 1 copies need at least 2 nodes"):
        partner_nodes(["only"])


def _holding(step, shards, meta=True, nodes=("a", "a", "b", "b")):
    return StepHolding(step, frozenset(shards), meta, len(nodes), tuple(nodes))


def test_the_newest_whole_step_is_chosen_and_its_metadata_found():
    rank_nodes = ["c", "c", "b", "b"]  # node a was lost; its ranks run on the spare c
    holdings = {0: [], 1: [], 2: [_holding(15, {0, 1, 2, 3}, meta=False), _holding(14, {0, 1, 2, 3})], 3: []}
    plan = choose_step(4, holdings, rank_nodes)
    assert (plan.step, plan.metadata_from) == (14, 2)  # step 15's metadata is nowhere: 14 is whole
    holdings[2] = [_holding(15, {0, 1, 2, 3}), _holding(14, {0, 1, 2, 3})]
    assert choose_step(4, holdings, rank_nodes).step == 15


def test_a_step_whose_copies_are_all_lost_names_the_ranks_and_nodes():
    rank_nodes = ["c", "c", "d", "d"]  # a and b both lost
    plan = choose_step(4, {r: [] for r in range(4)}, rank_nodes)
    assert plan.step is None and plan.lost_step is None
    assert plan.line(rank_nodes) == (
        "no in-memory checkpoint is left on the live nodes (c, d): the states of every rank were held only on "
        "nodes that are lost"
    )
    holdings = {0: [_holding(15, {0, 1})], 1: [_holding(15, {0, 1})], 2: [], 3: []}
    plan = choose_step(4, holdings, rank_nodes)
    assert plan.step is None and (plan.lost_step, plan.lost, plan.lost_nodes) == (15, [2, 3], ["b"])
    assert "rank(s) 2,3" in plan.line() and "only on b" in plan.line()
    # What the run falls back to: checkpoint.dir where it has one; without one it starts again, and says so.
    assert plan.line(rank_nodes, persistent=True).endswith("all lost; resuming from checkpoint.dir instead")
    assert plan.line(rank_nodes, persistent=False).endswith(
        "all lost; no checkpoint.dir to resume from (checkpoint.dir unset): training starts again from step 0"
    )


def test_a_step_of_another_world_size_is_not_used():
    holdings = {0: [_holding(15, {0, 1, 2, 3})]}
    assert choose_step(2, holdings, ["a", "b"]).step is None


def test_transfers_bring_each_missing_file_once_per_node():
    rank_nodes = ["c", "c", "b", "b"]
    node_files = {"c": set(), "b": {shard_file(r) for r in range(4)} | {METADATA}}
    needs = {
        0: [shard_file(0), shard_file(2)],
        1: [shard_file(1), shard_file(2)],
        2: [shard_file(2)],
        3: [shard_file(3)],
    }
    transfers = plan_transfers(needs, node_files, rank_nodes)
    assert [(t.source, t.dest, t.file) for t in transfers] == [
        (2, 0, shard_file(0)),
        (2, 0, shard_file(2)),
        (2, 1, shard_file(1)),
    ]


def test_holdings_are_read_from_complete_steps_only(tmp_path: Path):
    node = tmp_path / "node1"
    for step, complete in ((14, True), (15, False)):
        folder = node / step_dir_name(step)
        folder.mkdir(parents=True)
        (folder / shard_file(0)).write_bytes(b"x")
        (folder / shard_file(3)).write_bytes(b"x")
        (folder / METADATA).write_bytes(b"m")
        (folder / RANKS).write_text(json.dumps(["node1", "node2", "node2", "node1"]))
        if complete:
            (folder / COMPLETE).write_text("")
    (held,) = read_holdings(node)
    assert (held.step, held.shards, held.has_metadata, held.world_size) == (14, frozenset({0, 3}), True, 4)


def test_only_runs_untouched_for_a_day_are_removed_as_leftovers(tmp_path: Path):
    import os

    from hpkit.runtime.checkpoints.memory_layout import LEFTOVER_S, remove_leftovers

    now = 1_000_000.0
    for name, age in (("old", LEFTOVER_S + 60), ("recent", 60), ("mine", LEFTOVER_S + 60)):
        (tmp_path / name / "node1").mkdir(parents=True)
        os.utime(tmp_path / name, (now - age, now - age))
    remove_leftovers(tmp_path, keep="mine", now=now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "recent"]
