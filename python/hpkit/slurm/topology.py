"""Slurm's network topology: render a topology.conf, and read what the controller says it holds.

Recent HyperPod clusters manage topology.conf (TopologyPlugin=topology/tree, or topology/block from Slurm
23.11). What goes wrong, measured on the local clusters (tests/fixtures/topology):
- the plugin set and no topology.conf: Slurm 24.11's slurmctld retries for 60 s, then stops ("fatal: something
  wrong with opening/reading .../topology.conf"), and every sbatch fails;
- a topology.conf that leaves a node out: slurmctld runs, but a job that needs that node fails at sbatch
  ("Requested topology configuration is not available" under tree in 24.11, "Requested node configuration is
  not available" in 22.05 and under block).

Torch-free and standard library only: `hpkit check` (checks/slurm.py) reads it on a login node, and
slurm/dev/up.sh renders the local cluster's file with `python3 -m hpkit.slurm.topology render`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpkit.slurm.hostlist import HostlistError, expand

# Plugins that need no topology.conf: 22.05's topology/none, 24.11's topology/default (25.05's topology/flat).
FLAT_PLUGINS = frozenset({"topology/none", "topology/default", "topology/flat", ""})
TREE = "topology/tree"
BLOCK = "topology/block"
# The first Slurm with topology/block.
BLOCK_SINCE = (23, 11)


def _compress_run(names: Sequence[str]) -> str:
    """Names that differ only in a trailing number (node5..node8), as one hostlist entry."""
    match = [re.fullmatch(r"(.*?)(\d+)", name) for name in names]
    if len(names) == 1 or not all(match) or len({m.group(1) for m in match if m}) != 1:
        return ",".join(names)
    numbers = [int(m.group(2)) for m in match if m]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))) or any(
        m.group(2).startswith("0") for m in match if m
    ):
        return ",".join(names)
    prefix = match[0].group(1) if match[0] else ""
    return f"{prefix}[{numbers[0]}-{numbers[-1]}]"


def render(plugin: str, nodes: Sequence[str], group_size: int) -> str:
    """topology.conf for `plugin` over `nodes`, `group_size` nodes a leaf switch (tree) or a block (block).

    tree: leaves under one spine, so that every switch pair is connected and a job may span leaves. block:
    one block per group, and BlockSizes the group size (Slurm's smallest allocation unit there).
    """
    if group_size < 1:
        raise ValueError(f"group size must be at least 1, not {group_size}")
    if not nodes:
        raise ValueError("no nodes to place")
    groups = [nodes[i : i + group_size] for i in range(0, len(nodes), group_size)]
    lines = ["# Written by hpkit (python3 -m hpkit.slurm.topology render): every node of the cluster, once."]
    if plugin == TREE:
        for i, group in enumerate(groups, 1):
            lines.append(f"SwitchName=leaf{i} Nodes={_compress_run(group)}")
        leaves = f"leaf[1-{len(groups)}]" if len(groups) > 1 else "leaf1"
        lines.append(f"SwitchName=spine Switches={leaves}")
    elif plugin == BLOCK:
        if len(nodes) % group_size:
            # Slurm allocates whole base blocks: a short last block would hold nodes no job can use.
            raise ValueError(f"{len(nodes)} nodes do not fill blocks of {group_size}: pick a divisor")
        for i, group in enumerate(groups, 1):
            lines.append(f"BlockName=block{i} Nodes={_compress_run(group)}")
        lines.append(f"BlockSizes={group_size}")
    else:
        raise ValueError(f"cannot render a topology.conf for {plugin!r}: only {TREE} and {BLOCK} read one")
    return "\n".join(lines) + "\n"


def config_value(show_config: str, key: str) -> str | None:
    """A key's value in `scontrol show config` ('TopologyPlugin          = topology/tree'), or None."""
    for line in show_config.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return None


def conf_value(slurm_conf: str, key: str) -> str | None:
    """A key's value in slurm.conf's own text (the last one wins, as Slurm reads it; case-insensitive keys)."""
    found = None
    for line in slurm_conf.splitlines():
        line = line.split("#", 1)[0].strip()
        name, sep, value = line.partition("=")
        if sep and name.strip().lower() == key.lower():
            found = value.strip()
    return found


@dataclass(frozen=True)
class Group:
    """One switch (tree) or block (block) of `scontrol show topology`, or one line of topology.conf."""

    kind: str  # "switch" or "block"
    name: str
    nodes: tuple[str, ...]
    children: tuple[str, ...] = ()  # a switch's switches


def parse(text: str) -> list[Group]:
    """`scontrol show topology` (SwitchName=... Level=0 Nodes=..., BlockName=... Nodes=...) or topology.conf."""
    groups = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        fields = dict(word.partition("=")[::2] for word in line.split() if "=" in word)
        if "SwitchName" in fields:
            kind, name = "switch", fields["SwitchName"]
        elif "BlockName" in fields:
            kind, name = "block", fields["BlockName"]
        else:
            continue
        groups.append(
            Group(
                kind, name, tuple(expand(fields.get("Nodes", ""))), tuple(expand(fields.get("Switches", "")))
            )
        )
    return groups


def placed_nodes(groups: Iterable[Group]) -> set[str]:
    return {node for group in groups for node in group.nodes}


def switch_reaching_all(groups: Sequence[Group]) -> bool:
    """Whether one switch reaches every placed node through its descendants (tree): else a job that spans two
    parts of the tree cannot start (slurmctld warns "no switch can reach all nodes")."""
    switches = {g.name: g for g in groups if g.kind == "switch"}
    everyone = placed_nodes(switches.values())

    def below(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        if name in seen or name not in switches:
            return set()
        switch = switches[name]
        reached = set(switch.nodes)
        for child in switch.children:
            reached |= below(child, seen | {name})
        return reached

    return any(below(name) >= everyone for name in switches)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m hpkit.slurm.topology", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("render", help="write a topology.conf for these nodes to stdout")
    out.add_argument("--plugin", choices=[TREE, BLOCK, "tree", "block"], required=True)
    out.add_argument("--nodes", required=True, help="a Slurm host list: node[1-64]")
    out.add_argument(
        "--group-size", type=int, default=8, help="nodes per leaf switch (tree) or block (block)"
    )
    args = parser.parse_args(argv)
    plugin = args.plugin if "/" in args.plugin else f"topology/{args.plugin}"
    try:
        sys.stdout.write(render(plugin, expand(args.nodes), args.group_size))
    except (ValueError, HostlistError) as exc:
        print(f"hpkit.slurm.topology: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
