"""Slurm topology: hpkit.slurm.topology's reader and renderer, and `hpkit check`'s topology check, on what Slurm 22.05 and
24.11 really printed (tests/fixtures/topology, captured on the local clusters with each TopologyPlugin)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hpkit.checks import slurm
from hpkit.checks.context import Context, Roots
from hpkit.checks.result import Status
from hpkit.slurm import topology

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_expand_reads_slurm_host_lists() -> None:
    assert topology.expand("node[1-3,7],login1") == ["node1", "node2", "node3", "node7", "login1"]
    assert topology.expand("ip-[08-10]-x") == ["ip-08-x", "ip-09-x", "ip-10-x"]
    assert topology.expand("") == []


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_tree_as_both_versions_show_it(version: str) -> None:
    groups = topology.parse(fixture(f"{version}-tree.topology.txt"))
    assert [(g.name, g.nodes, g.children) for g in groups] == [
        ("leaf1", ("node1",), ()),
        ("leaf2", ("node2",), ()),
        ("spine", ("node1", "node2"), ("leaf1", "leaf2")),
    ]
    assert topology.switch_reaching_all(groups)
    no_spine = topology.parse(fixture(f"{version}-tree-no-spine.topology.txt"))
    assert topology.placed_nodes(no_spine) == {"node1", "node2"} and not topology.switch_reaching_all(
        no_spine
    )
    missing = topology.parse(fixture(f"{version}-tree-missing-node.topology.txt"))
    assert topology.placed_nodes(missing) == {"node1"}


def test_block_as_24_11_shows_it() -> None:
    groups = topology.parse(fixture("24.11-block.topology.txt"))
    assert [(g.kind, g.name, g.nodes) for g in groups] == [("block", "block1", ("node1", "node2"))]


@pytest.mark.parametrize(
    "case, plugin",
    [
        ("22.05-default", "topology/none"),
        ("24.11-default", "topology/default"),
        ("24.11-tree", "topology/tree"),
    ],
)
def test_plugin_from_show_config(case: str, plugin: str) -> None:
    assert topology.config_value(fixture(f"{case}.config.txt"), "TopologyPlugin") == plugin


@pytest.mark.parametrize("plugin", [topology.TREE, topology.BLOCK])
def test_rendered_file_reads_back_with_every_node_once(plugin: str) -> None:
    nodes = [f"node{i}" for i in range(1, 65)]
    groups = topology.parse(topology.render(plugin, nodes, 8))
    placed = [n for g in groups if g.name.startswith(("leaf", "block")) for n in g.nodes]
    if plugin == topology.TREE:
        assert topology.switch_reaching_all(groups)
    assert sorted(placed, key=lambda n: int(n[4:])) == nodes


def test_render_refuses_what_slurm_could_not_use() -> None:
    with pytest.raises(ValueError, match="do not fill blocks of 3"):
        topology.render(topology.BLOCK, ["node1", "node2", "node3", "node4"], 3)
    with pytest.raises(ValueError, match="only topology/tree and topology/block"):
        topology.render("topology/none", ["node1"], 1)


def test_render_command_prints_a_file_or_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert topology.main(["render", "--plugin", "tree", "--nodes", "node[1-4]", "--group-size", "2"]) == 0
    assert (
        "SwitchName=leaf2 Nodes=node[3-4]\nSwitchName=spine Switches=leaf[1-2]\n" in capsys.readouterr().out
    )
    assert topology.main(["render", "--plugin", "block", "--nodes", "node[1-3]", "--group-size", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and "pick a divisor" in out.err


# --- the check, over Slurm's captured answers -------------------------------------------------------------


def cluster(tmp_path: Path, version: str, case: str, *, controller: bool = True) -> Context:
    """A login node whose scontrol and sinfo print what the real cluster printed in this case."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    prefix = FIXTURES / f"{version}-{case}"
    if controller:
        scontrol = f"""\
            case "$2" in
              config) cat {prefix}.config.txt ;;
              topology) cat {prefix}.topology.txt; cat {prefix}.topology.stderr >&2 2>/dev/null; exit 0 ;;
            esac
            """
        sinfo = f"cat {FIXTURES / f'{version}-sinfo-nodes.txt'}\n"
    else:  # as when slurmctld stopped on a missing topology.conf
        scontrol = 'echo "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure)" >&2\nexit 1\n'
        sinfo = scontrol
    for name, body in (("scontrol", scontrol), ("sinfo", sinfo)):
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
        path.chmod(0o755)
    roots = Roots.under(tmp_path / "root")
    return Context(profile="login", roots=roots, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, probe_timeout=5.0)


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_check_passes_without_a_topology_plugin(tmp_path: Path, version: str) -> None:
    result = slurm.slurm_topology(cluster(tmp_path, version, "default"))
    assert result.status is Status.PASS and "no topology.conf needed" in result.detail


@pytest.mark.parametrize("version, case", [("22.05", "tree"), ("24.11", "tree"), ("24.11", "block")])
def test_check_passes_when_every_node_is_placed(tmp_path: Path, version: str, case: str) -> None:
    result = slurm.slurm_topology(cluster(tmp_path, version, case))
    assert result.status is Status.PASS, result
    assert f"topology/{case}" in result.detail and "all 2 nodes" in result.detail


@pytest.mark.parametrize(
    "version, case",
    [("22.05", "tree-missing-node"), ("24.11", "tree-missing-node"), ("24.11", "block-missing-node")],
)
def test_check_names_the_node_no_switch_or_block_holds(tmp_path: Path, version: str, case: str) -> None:
    result = slurm.slurm_topology(cluster(tmp_path, version, case))
    assert result.status is Status.FAIL, result
    assert "1 of 2 nodes" in result.detail and "(node2)" in result.detail
    assert "hpkit.slurm.topology render" in result.fix and "scontrol reconfigure" in result.fix


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_check_fails_a_tree_without_a_top_switch(tmp_path: Path, version: str) -> None:
    result = slurm.slurm_topology(cluster(tmp_path, version, "tree-no-spine"))
    assert result.status is Status.FAIL and "no switch reaches all 2 nodes" in result.detail
    assert "SwitchName=spine" in result.fix


def test_check_names_a_missing_topology_conf_when_the_controller_is_down(tmp_path: Path) -> None:
    ctx = cluster(tmp_path, "24.11", "tree", controller=False)
    conf = tmp_path / "etc-slurm" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text("ClusterName=c\nTopologyPlugin=topology/tree  # managed by the cluster\n")
    ctx.env = {**ctx.env, "SLURM_CONF": str(conf)}
    result = slurm.slurm_topology(ctx)
    assert result.status is Status.FAIL, result
    assert f"{conf.parent / 'topology.conf'} is missing" in result.detail and "fatal" in result.detail
    (conf.parent / "topology.conf").write_text(topology.render(topology.TREE, ["node1", "node2"], 1))
    assert slurm.slurm_topology(ctx).status is Status.SKIP  # the file is there: the slurm check says the rest
