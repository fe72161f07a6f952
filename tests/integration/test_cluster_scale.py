"""hpkit's tools on a wide local cluster: NET=netns (an address per node), one bring-up for the module.

- the cluster comes up with every node idle at an address of its own;
- `hpkit check --all-nodes` answers for every node, and its pairwise bandwidth names the one node whose link is
  slowed (slurm/dev/net.sh slow: 10 Mbit/s) and no other;
- `hpkit train` with one rank per node through hpkit-torchrun and the hang watchdog on, and a spare: the last
  rank stops itself (HPKIT_FAULT stop: SIGSTOP) before step 3; the watchdog names
  it and its node, the spare takes that node's place in the same job, training runs to its last step with the
  re-run steps' losses equal to the first run's, and `hpkit why` names the node.

`make test` runs the small version: 16 nodes, the check without its bandwidth step (torch-free on each node), a
2-rank job (+1 spare). The wide one, HPKIT_SCALE_TESTS=1 (minutes on a quiet 2-core machine): 64 nodes, the
bandwidth across 32 of them (node23 slowed), a 16-rank job (+1 spare). Torch is what limits the width here, not Slurm: BENCHMARKS.md, "The local cluster at scale".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _clusters import slot
from hpkit import devcluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_cluster_scale import drill, losses

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
WIDE = os.environ.get("HPKIT_SCALE_TESTS") == "1"
NODES = 64 if WIDE else 16
# Each runs a torch process in the bandwidth step: 64 did not connect here (BENCHMARKS.md).
BANDWIDTH_NODES = 32
JOB_NODES = 16 if WIDE else 2  # one rank per node, and one spare besides
SLOW = "node23"
# Stopped early, before the first checkpoint (step 10): the restart runs steps 1.. again, which must match.
STEPS, INTERVAL, STOP_AT = 24, 10, 2
PORT, FIRST_JOB_ID = slot("scale")


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    state = tmp_path_factory.mktemp("scale")
    env = devcluster.client_env(state / "cluster", PORT, FIRST_JOB_ID, nodes=NODES, cpus=1, net="netns")
    # Jobs run this environment's Python (as hpkit submit does); the metadata service is never reached.
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        TMPDIR=str(state),
        AWS_EC2_METADATA_DISABLED="true",
    )
    saved = os.environ.get("SLURM_CONF")
    started = time.monotonic()
    try:
        devcluster.up(env)
        print(f"\n{NODES} nodes up in {time.monotonic() - started:.1f} s")
        # CliBackend (hpkit submit) asks the cluster that SLURM_CONF names.
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        yield env
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        started = time.monotonic()
        devcluster.down(env)
        print(f"\n{NODES} nodes down in {time.monotonic() - started:.1f} s")


def _run(env: dict[str, str], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)


def test_every_node_is_idle_at_an_address_of_its_own(wide: dict[str, str]) -> None:
    states = _run(wide, "sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
    assert sorted(line.split()[1] for line in states if line) == ["idle"] * NODES, states
    text = _run(wide, "scontrol", "show", "nodes", "-o").stdout
    addrs = [w.split("=", 1)[1] for w in text.split() if w.startswith("NodeAddr=")]
    assert len(addrs) == NODES and len(set(addrs)) == NODES, addrs
    assert devcluster.node_address(wide, f"node{NODES}") in addrs


def _check(env: dict[str, str], out: Path, *extra: str) -> dict:
    argv = [sys.executable, "-m", "hpkit", "check", "--all-nodes", "--json", "--output-dir", str(out), *extra]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout)


def test_all_nodes_check_answers_for_every_node(wide: dict[str, str], tmp_path: Path) -> None:
    every = _check(wide, tmp_path / "all")
    assert every["nodes"] == [f"node{i}" for i in range(1, NODES + 1)] and every["no_result"] == {}, every
    # The same machine under every node: nothing to tell one from another without a measure.
    assert every["exclude"] == [] and every["facts_differ"] == {}, every["exclude"]


@pytest.mark.scale_wide  # 32 torch processes: collected only with HPKIT_SCALE_TESTS=1 (tests/conftest.py)
def test_all_nodes_bandwidth_names_the_slowed_node_and_no_other(wide: dict[str, str], tmp_path: Path) -> None:
    devcluster.slow(wide, SLOW, rate="10mbit")
    try:
        measured = _check(
            wide,
            tmp_path / "bandwidth",
            "--nodelist",
            f"node[1-{BANDWIDTH_NODES}]",
            "--bandwidth",
            "--bandwidth-size",
            "256K",
            "--bandwidth-rounds",
            "3",
        )
    finally:
        devcluster.unslow(wide, SLOW)
    bandwidth = measured["bandwidth"]
    assert bandwidth is not None and bandwidth["median_gbps"], measured["per_node"]
    assert bandwidth["slow"] == [SLOW], bandwidth
    assert measured["exclude"] == [SLOW] and measured["exclude_option"] == f"--exclude={SLOW}"


def test_a_stopped_rank_is_named_and_a_spare_takes_its_node(wide: dict[str, str], tmp_path: Path) -> None:
    d = drill(wide, tmp_path, JOB_NODES, spares=1, steps=STEPS, interval=INTERVAL, stop_at_step=STOP_AT)
    phases = d.phases()
    print(f"\n{JOB_NODES}-rank job: {phases}, stopped rank {d.stopped_rank} on {d.stopped_node}")
    assert d.stopped_node, f"rank {JOB_NODES - 1} never stopped after step {STOP_AT}: job {d.job} {d.state}"
    # The watchdog named the stopped rank and its node.
    verdict = d.verdict
    assert verdict.get("culprits") == [d.stopped_rank], (verdict, d.events)
    assert f"rank {d.stopped_rank} on {d.stopped_node}" in verdict["line"], verdict
    assert (Path(d.verdict_path).parent / "culprit_nodes").read_text() == f"{d.stopped_node}\n"
    # The spare took the node's place in the same job, which ran to its end.
    assert d.state == "COMPLETED", d.events
    swaps = [(e["node"], e["spare"]) for e in d.events if e["type"] == "spare_swap"]
    (spare,) = next(e["spares"] for e in d.events if e["type"] == "run_started")
    assert swaps == [(d.stopped_node, spare)], d.events
    restarts = [e for e in d.events if e["type"] == "restart"]
    assert [e["reason"] for e in restarts] == ["hang"] and d.stopped_node not in restarts[0]["nodes"], (
        restarts
    )
    assert spare in restarts[0]["nodes"]
    # Every step ran, and the steps run again after the restart (from the last checkpoint) match the first run's.
    series = losses(tmp_path / f"scale{JOB_NODES}.jsonl")
    assert sorted({step for step, _ in series}) == list(range(1, STEPS + 1)), series
    first: dict[int, float] = {}
    again = 0
    for step, loss in series:
        if step in first:
            again += 1
            assert loss == pytest.approx(first[step], rel=1e-6, abs=1e-7), (step, series)
        first.setdefault(step, loss)
    assert again >= 1, (
        f"no step ran twice: the restart did not resume from a checkpoint behind the stop {series}"
    )
    # hpkit why names the node.
    why = _run(wide, sys.executable, "-m", "hpkit", "why", d.job, "--json")
    assert why.returncode == 0, why.stderr
    answer = json.loads(why.stdout)
    assert answer["node"] == d.stopped_node and d.stopped_node in answer["summary"], answer
