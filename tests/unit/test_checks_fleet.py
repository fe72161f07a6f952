"""Comparing nodes: host lists, the fleet analysis, the pairing schedule, facts and the system root."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _imds_server import closed_port

from hpkit.checks import fleet
from hpkit.commands import check, check_nodes
from hpkit.netbench.pairs import best_per_node, confirmations, round_robin
from hpkit.slurm.hostlist import compress, natural_key


@pytest.fixture(autouse=True)
def _never_real_imds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", closed_port())
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    monkeypatch.delenv(check.SYSROOT_ENV, raising=False)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["node3", "node1", "node2"], "node[1-3]"),
        (["node1", "node2", "node4", "node10", "node11"], "node[1-2,4,10-11]"),
        (["node7"], "node7"),
        (["gpu01", "gpu02", "gpu10"], "gpu10,gpu[01-02]"),  # padded and unpadded stay apart
        (["login", "node1"], "login,node1"),
        ([], ""),
    ],
)
def test_compress_host_lists(names: list[str], expected: str) -> None:
    assert compress(names) == expected


def test_natural_order() -> None:
    assert sorted(["node10", "node2", "node1"], key=natural_key) == ["node1", "node2", "node10"]


def report(node: str, statuses: dict[str, str], **facts: object) -> fleet.NodeReport:
    return fleet.NodeReport(
        node, statuses=statuses, details={n: f"{n} on {node}" for n in statuses}, facts=facts
    )


def test_failures_on_some_nodes_are_excluded_and_failures_everywhere_are_not() -> None:
    reports = [
        report(f"node{i}", {"cuda": "FAIL", "shared-fs": "FAIL" if i == 3 else "PASS", "efa": "WARN"})
        for i in range(1, 5)
    ]
    result = fleet.analyse(reports)
    assert result.cluster_wide == ("cuda",)
    assert result.node_failures == {"node3": ("shared-fs",)}
    assert result.exclude == ("node3",)
    rows = {row.name: row for row in result.rows}
    assert rows["shared-fs"].nodes == {"PASS": ("node1", "node2", "node4"), "FAIL": ("node3",)}
    assert rows["efa"].nodes == {"WARN": ("node1", "node2", "node3", "node4")}
    assert not result.ok


def test_facts_that_differ_name_the_odd_nodes() -> None:
    reports = [report(f"node{i}", {"gpus": "PASS"}, gpu_count=8, driver="550.90.07") for i in range(1, 6)]
    reports[1] = report("node2", {"gpus": "PASS"}, gpu_count=7, driver="550.90.07")
    reports[4] = report("node5", {"gpus": "PASS"}, gpu_count=8, driver="535.104.05")
    result = fleet.analyse(reports)
    spreads = {f.name: f for f in result.facts}
    assert set(spreads) == {"gpu_count", "driver"}
    assert spreads["gpu_count"].majority == 8 and dict(spreads["gpu_count"].differ) == {"node2": 7}
    assert dict(spreads["driver"].differ) == {"node5": "535.104.05"}
    assert result.exclude == ("node2", "node5")
    doc = result.to_json()
    assert doc["exclude_option"] == "--exclude=node2,node5"
    assert doc["facts_differ"]["gpu_count"]["majority_nodes"] == ["node1", "node3", "node4", "node5"]


def test_a_split_fact_excludes_nobody_but_is_not_ok() -> None:
    reports = [report("node1", {}, kernel="6.1"), report("node2", {}, kernel="6.2")]
    result = fleet.analyse(reports)
    assert result.facts[0].split and result.exclude == () and not result.ok


def test_silent_nodes_and_a_healthy_fleet() -> None:
    healthy = [report(f"node{i}", {"gpus": "PASS"}, gpu_count=8) for i in (1, 2)]
    assert fleet.analyse(healthy).ok
    result = fleet.analyse([*healthy, fleet.NodeReport("node3", error="no report")])
    assert result.no_result == {"node3": "no report"} and result.exclude == ("node3",)


def test_bandwidth_outliers() -> None:
    bw = fleet.bandwidth_outliers({"node1": 10.0, "node2": 9.0, "node3": 4.0, "node4": 11.0, "node5": None})
    assert bw.median_gbps == 9.5 and bw.slow == ("node3", "node5")
    assert fleet.bandwidth_outliers({"a": 10.0, "b": 6.0}, fraction=0.5).slow == ()
    # The test itself failed: no node is to blame, but the fleet is not declared fine either.
    failed = fleet.analyse([report("a", {}), report("b", {})], {"a": None, "b": None})
    assert failed.exclude == () and not failed.ok


def test_parse_node_report_tags_the_node_and_merges_facts() -> None:
    text = json.dumps(
        {
            "node": "node7",
            "checks": [
                {"name": "gpus", "status": "PASS", "detail": "8 × H100", "facts": {"gpu_count": 8}},
                {"name": "kernel", "status": "PASS", "detail": "Linux 6.1", "facts": {"kernel": "6.1"}},
            ],
        }
    )
    parsed = fleet.parse_node_report(text, "fallback")
    assert parsed.node == "node7" and parsed.facts == {"gpu_count": 8, "kernel": "6.1"}
    assert fleet.parse_node_report("Traceback (most recent call last):", "node9").error.startswith(
        "unreadable"
    )
    assert fleet.parse_node_report("", "node9").node == "node9"


def test_round_robin_pairs_every_node_with_new_partners() -> None:
    schedule = round_robin(4, 3)
    assert len(schedule) == 3
    met = [pair for pairs in schedule for pair in pairs]
    assert len(set(met)) == 6  # all 6 pairs of 4 nodes, none twice
    for pairs in schedule:
        assert sorted(rank for pair in pairs for rank in pair) == [0, 1, 2, 3]
    odd = round_robin(5, 5)
    assert all(len(pairs) == 2 for pairs in odd)  # one node sits out each round
    assert len({pair for pairs in odd for pair in pairs}) == 10
    assert round_robin(4, 6)[3:] == schedule  # more rounds than pairings: round again
    assert round_robin(1, 3) == []


def test_best_pair_per_node() -> None:
    doc = {
        "nodes": ["a", "b", "c", "d"],
        "rounds": [
            [
                {"nodes": ["a", "d"], "busbw_gbps": 1.0, "wrong": 0},
                {"nodes": ["b", "c"], "busbw_gbps": 9.0, "wrong": 0},
            ],
            [
                {"nodes": ["a", "c"], "busbw_gbps": 8.0, "wrong": 0},
                {"nodes": ["b", "d"], "busbw_gbps": 2.0, "wrong": 3},
            ],
        ],
    }
    assert best_per_node(doc) == {"a": 8.0, "b": 9.0, "c": 9.0, "d": 1.0}
    # A second look counts like any round.
    doc["confirm"] = [{"nodes": ["b", "d"], "busbw_gbps": 7.5, "wrong": 0}]
    assert best_per_node(doc) == {"a": 8.0, "b": 9.0, "c": 9.0, "d": 7.5}


def entry(x: str, y: str, gbps: float, wrong: int = 0) -> dict:
    return {"nodes": [x, y], "busbw_gbps": gbps, "wrong": wrong}


def test_flagged_nodes_are_measured_again_at_once_each_with_a_fast_partner_of_its_own() -> None:
    names = ["a", "b", "c", "d"]
    # d is slow in both its pairings; b's best is c's: b and c are 9, the median 8.5.
    doc = {"nodes": names, "rounds": [[entry("a", "d", 1.0), entry("b", "c", 9.0)], [entry("a", "c", 8.0)]]}
    assert confirmations(names, doc, 0.5) == [[(1, 3)]]  # d (rank 3) with b, the first of the fastest
    # Two flagged (the fleet's fraction decides who): one round, a with b and d with c, not both with b.
    doc["rounds"].append([entry("b", "d", 2.0)])
    assert confirmations(names, doc, 0.95) == [[(0, 1), (2, 3)]]
    # A second look that clears d leaves nothing to measure.
    doc["confirm"] = [entry("b", "d", 8.8)]
    assert confirmations(names, doc, 0.5) == []
    # Nothing measured, or everyone flagged: no partner to measure against.
    assert confirmations(names, {"nodes": names, "rounds": []}, 0.5) == []


def test_a_bad_rack_is_measured_again_in_one_round_not_one_round_per_node() -> None:
    names = [f"node{i}" for i in range(2000)]
    slow = set(range(0, 2000, 20))  # 100 nodes, spread over the fleet
    # Each rank paired with its neighbour; a pair is as fast as its slower node, the fast ones all different.
    rounds = [
        [
            entry(names[r], names[r + 1], 0.1 if {r, r + 1} & slow else 10.0 + r / 1000)
            for r in range(0, 2000, 2)
        ]
    ]
    doc = {"nodes": names, "rounds": rounds}
    flagged = {names[r] for r in slow} | {names[r + 1] for r in slow}  # a slow node's partner reads slow too
    (looks,) = confirmations(names, doc, 0.5)
    measured = [rank for pair in looks for rank in pair]
    assert len(measured) == len(set(measured)) == 2 * len(flagged), "a node in two pairs of one round"
    assert {names[r] for pair in looks for r in pair} >= flagged
    partners = {r for pair in looks for r in pair if names[r] not in flagged}
    fastest = sorted((r for r in range(2000) if names[r] not in flagged), reverse=True)[: len(flagged)]
    assert partners == set(fastest)  # the fastest unflagged nodes, one each


def test_more_flagged_nodes_than_partners_take_as_many_rounds_as_it_takes() -> None:
    names = ["a", "b", "c", "d", "e"]
    # c, d and e never gave a right answer (flagged: never measured); a and b are the only partners.
    doc = {
        "nodes": names,
        "rounds": [[entry("a", "b", 9.0), entry("c", "d", 9.0, wrong=1)], [entry("a", "e", 8.0, wrong=1)]],
    }
    looks = confirmations(names, doc, 0.5)
    assert looks == [[(0, 2), (1, 3)], [(0, 4)]]
    for pairs in looks:
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks))


def test_sysroot_from_the_environment_moves_every_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    info = root / "proc" / "driver" / "nvidia" / "gpus" / "0000:10:00.0" / "information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t NVIDIA H100 80GB HBM3\n")
    (root / "proc" / "sys" / "kernel").mkdir(parents=True)
    (root / "proc" / "sys" / "kernel" / "osrelease").write_text("6.1.0-test\n")
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "mountinfo").write_text(
        "22 1 259:1 / / rw - ext4 /dev/nvme0n1p1 rw\n"
        "30 22 259:2 / /opt/dlami/nvme rw - ext4 /dev/nvme1n1 rw\n"
        "31 22 0:60 / /fsx rw - lustre 10.0.0.5@tcp:/fsx rw\n"
        "40 22 0:70 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw\n"
        "41 22 259:1 /pods/x /var/lib/kubelet/pods/x rw - ext4 /dev/nvme0n1p1 rw\n"
    )
    monkeypatch.setenv(check.SYSROOT_ENV, str(root))
    monkeypatch.setenv("SLURMD_NODENAME", "node42")
    code = check.main(["check", "--only", "gpus,kernel,libstdcxx,shared-fs", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["node"] == "node42" and doc["sysroot"] == str(root)
    rows = {row["name"]: row for row in doc["checks"]}
    assert rows["gpus"]["facts"] == {"gpu_count": 1, "gpu_model": "NVIDIA H100 80GB HBM3"}
    assert rows["kernel"]["facts"] == {"kernel": "6.1.0-test"}
    # The node's layout, without what container runtimes mount per container.
    assert rows["shared-fs"]["facts"] == {
        "shared_mounts": ["/fsx (lustre)"],
        "local_mounts": ["/ (ext4)", "/opt/dlami/nvme (ext4)"],
    }
    # This process's own libraries are not the tree's: libstdc++ is still found where it was loaded.
    assert rows["libstdcxx"]["status"] == "PASS"
    assert code == 0


def test_a_missing_sysroot_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(check.SYSROOT_ENV, "/nonexistent/root")
    assert check.main(["check", "--only", "kernel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hpkit check: error: $HPKIT_SYSROOT: /nonexistent/root is not a folder; point it at a system tree or unset it"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "2"], "--nodes goes with --all-nodes"),
        (["--bandwidth"], "--bandwidth goes with --all-nodes"),
        (["--all-nodes", "--profile", "login"], "drop --profile"),
        (["--all-nodes", "--bandwidth-threshold", "2"], "in (0, 1]"),
    ],
)
def test_all_nodes_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["check", *argv]) == 2
    assert message in capsys.readouterr().err


def test_all_nodes_refuses_what_cannot_go_into_sbatch_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before Slurm is asked anything: this machine's clients have no cluster configured here.
    assert check.main(["check", "--all-nodes", "--partition", "a b", "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--partition 'a b'" in err[0]
    assert check.main(["check", "--all-nodes", "--output-dir", str(tmp_path / "with space")]) == 1
    assert "--output-dir" in capsys.readouterr().err
    # A plain token that is no Slurm time would pass as a word and fail in sbatch: refused here instead.
    assert check.main(["check", "--all-nodes", "--time-limit", "ten", "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--time-limit 'ten' is not a Slurm time" in err[0], err


def test_the_job_script_runs_one_check_per_node_and_the_pairs(tmp_path: Path) -> None:
    req = check_nodes.Request(
        partition="p5",
        nodes=None,
        nodelist="node[1-4]",
        check_args=("--skip", "imds"),
        output_dir=tmp_path,
        time_limit="00:05:00",
        wait_timeout_s=60,
        python="/shared/venv/bin/python",
        bandwidth=True,
    )
    script = check_nodes.render_script(req, 4)
    lines = script.splitlines()
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --partition=p5" in lines and "#SBATCH --nodelist=node[1-4]" in lines
    check_step = next(line for line in lines if "-m hpkit check" in line)
    assert check_step.startswith("srun --ntasks-per-node=1")
    assert f"--output={tmp_path}/check-%j-%t.json" in check_step
    assert check_step.endswith("--profile compute --json --skip imds")
    assert any("-m hpkit.netbench.pairs --rounds 3" in line for line in lines)
    path = tmp_path / "check-nodes.sbatch"
    path.write_text(script)
    for lint in (["bash", "-n", str(path)], ["shellcheck", str(path)]):
        done = subprocess.run(lint, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_paths_named_inside_a_sysroot_stay_inside_it(tmp_path: Path) -> None:
    from hpkit.checks import network_efa
    from hpkit.checks.context import Context, Roots

    root = tmp_path / "image"
    plugin = root / "opt" / "amazon" / "ofi-nccl" / "lib" / "libnccl-net.so"
    plugin.parent.mkdir(parents=True)
    plugin.touch()
    conf = root / "etc" / "ld.so.conf.d" / "ofi.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("/opt/amazon/ofi-nccl/lib\n")  # as the image's own loader reads it
    ctx = Context(profile="compute", roots=Roots.under(root), env={})
    result = network_efa.aws_ofi_nccl(ctx)
    assert result.status.value == "PASS" and str(plugin) in result.detail
