"""Pairwise bandwidth: every node measured against a few different partners, all pairs of a round at once.

One task per node (`srun --ntasks-per-node=1 python -m hpkit.netbench.pairs`). The tasks join one process
group, then each round splits it into pairs (a round-robin tournament: no pair repeats) and every pair
times all_reduce on its own subgroup while the other pairs do the same, as a training job's traffic would
load the fabric. A slow node drags down each pair it is in; a good node paired with it once still has
fast rounds with its other partners, which is why a node's figure is its best pair's (see
hpkit.checks.fleet). The nodes the rounds would flag are measured again, all at once, each with a partner of
its own among the fastest nodes they do not flag (`confirmations`, at most CONFIRM_TRIES times): a node that was
only unlucky in every round (its host busy whenever it measured) is cleared, and a slow one is named on more than
one look. Rank 0 prints one JSON document; the other ranks print nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from hpkit.arg_types import byte_size, positive_int
from hpkit.checks.fleet import DEFAULT_BANDWIDTH_FRACTION, bandwidth_outliers

Pair = tuple[int, int]
# Looks again at a flagged node: on a 2-core host under a test suite's load, a healthy node read 5x below its
# peers in all four of its pairings (at two moments) and was named beside the slow one.
CONFIRM_TRIES = 2
# The defaults of `hpkit check --all-nodes --bandwidth` and of this module's own command line.
DEFAULT_ROUNDS = 3
DEFAULT_SIZE = "16M"


def round_robin(n: int, rounds: int) -> list[list[Pair]]:
    """`rounds` pairings of ranks 0..n-1, no pair repeating before every pair has met (the circle method).

    With an odd n one rank sits each round out. There are n-1 distinct pairings (n even) or n (odd); more
    rounds go round again, which gives every node more than one chance at a quiet moment on a busy host.
    """
    if n < 2:
        return []
    seats: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(seats)
    distinct = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = seats[i], seats[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        distinct.append(sorted(pairs))
        # Keep seat 0, turn the others one place.
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return [distinct[r % len(distinct)] for r in range(rounds)]


def confirmations(names: Sequence[str], document: dict, fraction: float) -> list[list[Pair]]:
    """The second looks to take next, as rounds of pairs measured at once: every node that `document`'s figures
    flag (the fleet's own rule, hpkit.checks.fleet.bandwidth_outliers) with a partner of its own among the nodes
    they do not flag, the fastest first. No node is in two pairs of a round, so a look is not slowed by another
    look; and since a measured node is flagged below a fraction of the median, fewer nodes are flagged than are
    left as partners: one round, however many nodes a bad rack holds (one look after another was a world-wide
    round each). Empty when nothing is flagged, or no node is left to measure against."""
    best = best_per_node(document)
    slow = set(bandwidth_outliers(best, fraction).slow)
    flagged = [rank for rank, name in enumerate(names) if name in slow]
    healthy = sorted(
        (rank for rank, name in enumerate(names) if name not in slow and best.get(name) is not None),
        key=lambda rank: -(best[names[rank]] or 0.0),
    )
    if not flagged or not healthy:
        return []
    # More flagged nodes than partners (only where many were never measured, whose pairs all failed): as many
    # rounds as it takes.
    batches = [flagged[start : start + len(healthy)] for start in range(0, len(flagged), len(healthy))]
    return [
        sorted(
            (min(rank, partner), max(rank, partner))
            for rank, partner in zip(batch, healthy[: len(batch)], strict=True)
        )
        for batch in batches
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpkit.netbench.pairs", description="Pairwise all_reduce bandwidth, one task per node."
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=DEFAULT_ROUNDS,
        help=f"pairings to run (default {DEFAULT_ROUNDS})",
    )
    # A string default goes through `type`, as a user's value would.
    parser.add_argument(
        "--size", type=byte_size, default=DEFAULT_SIZE, help=f"all_reduce size (default {DEFAULT_SIZE})"
    )
    parser.add_argument("--iters", type=positive_int, default=10, help="timed iterations (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    parser.add_argument(
        "--confirm-below",
        type=float,
        default=DEFAULT_BANDWIDTH_FRACTION,
        metavar="F",
        help="measure again the nodes below F x the median, each with a partner of its own "
        "(hpkit check's --bandwidth-threshold)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch.distributed as dist

    from hpkit.netbench.collectives import SweepConfig, measure
    from hpkit.runtime.env import distributed

    cfg = SweepConfig(("all_reduce",), (args.size,), args.iters, args.warmup, "float", check=True)
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    with distributed() as run:
        device, backend = run.device.torch_device(), run.device.backend
        world, rank = run.launch.world_size, run.launch.rank
        names: list[str | None] = [None] * world
        dist.all_gather_object(names, node)

        def measured_round(pairs: list[Pair]) -> list[dict]:
            """Every pair of `pairs` at once, each on its own subgroup; every rank returns all their figures."""
            # Every rank creates every group, in the same order: that is how torch.distributed agrees on them.
            groups = {pair: dist.new_group(list(pair)) for pair in pairs}
            mine = next((pair for pair in pairs if rank in pair), None)
            measured = None
            if mine is not None:
                row = measure(cfg, device, backend, group=groups[mine])[-1]
                if rank == mine[0]:
                    measured = {
                        "nodes": [names[mine[0]], names[mine[1]]],
                        "busbw_gbps": row.busbw_gbps,
                        "time_us": row.time_us,
                        "wrong": row.wrong,
                    }
            gathered: list[dict | None] = [None] * world
            # Also the end of the round: no pair starts the next pairing while others still measure.
            dist.all_gather_object(gathered, measured)
            if mine is not None:
                dist.destroy_process_group(groups[mine])
            return [entry for entry in gathered if entry is not None]

        document: dict = {"nodes": names, "rounds": [], "confirm": []}
        for pairs in round_robin(world, args.rounds):
            document["rounds"].append(measured_round(pairs))
        for _ in range(CONFIRM_TRIES):
            # Rank 0 decides, so that every rank creates the same groups in the same order.
            todo: list[list[list[Pair]] | None] = [
                confirmations(names, document, args.confirm_below) if rank == 0 else None
            ]
            dist.broadcast_object_list(todo, src=0)
            if not todo[0]:
                break
            for pairs in todo[0]:
                document["confirm"].extend(measured_round(pairs))
        if rank == 0:
            json.dump(
                {"op": "all_reduce", "size_bytes": args.size, "backend": backend, **document},
                sys.stdout,
            )
            sys.stdout.write("\n")
            sys.stdout.flush()
    return 0


def best_per_node(document: dict) -> dict[str, float | None]:
    """Each node's best pair busbw over the rounds and the second looks (None: it was never paired or its pair
    failed)."""
    best: dict[str, float | None] = {name: None for name in document.get("nodes", [])}
    for round_ in [*document.get("rounds", []), document.get("confirm", [])]:
        for entry in round_:
            value = entry.get("busbw_gbps")
            if entry.get("wrong"):
                continue  # wrong data is no bandwidth
            for name in entry.get("nodes", []):
                current = best.get(name)
                best[name] = value if current is None else max(current, value)
    return best


if __name__ == "__main__":
    sys.exit(main())
