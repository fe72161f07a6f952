"""When the probe of a failing step's nodes has its answer (hpkit.supervise.probe.silent_nodes)."""

from __future__ import annotations

from hpkit.supervise.probe import (
    PROBE_FACTOR,
    PROBE_MIN_S,
    PROBE_TIMEOUT_S,
    launch_failed_node,
    silent_nodes,
    unanswering,
)

NODES = ["node1", "node2", "node3"]


def test_every_node_done_is_known_at_once():
    assert silent_nodes(NODES, {"node1": 0.2, "node3": 0.3}, ["node2"], 0.3) == ["node2"]
    assert silent_nodes(NODES, {n: 0.2 for n in NODES}, [], 0.2) == []


def test_a_silent_node_is_called_so_at_the_factor_of_the_slowest_answer_and_not_before():
    answered = {"node2": 0.4, "node3": 0.9}  # the slowest answer sets the bar: 3 x 0.9 = 2.7 s
    bar = PROBE_FACTOR * 0.9
    assert PROBE_MIN_S < bar < PROBE_TIMEOUT_S
    assert silent_nodes(NODES, answered, [], bar - 0.05) is None
    assert silent_nodes(NODES, answered, [], bar) == ["node1"]


def test_never_sooner_than_the_floor_however_fast_the_others():
    answered = {"node2": 0.05, "node3": 0.1}
    assert silent_nodes(NODES, answered, [], PROBE_MIN_S - 0.05) is None
    assert silent_nodes(NODES, answered, [], PROBE_MIN_S) == ["node1"]


def test_a_loaded_cluster_waits_up_to_the_timeout_and_no_longer():
    answered = {"node2": 2.0, "node3": 4.0}  # 3 x 4.0 is past the timeout
    assert silent_nodes(NODES, answered, [], PROBE_TIMEOUT_S - 0.05) is None
    assert silent_nodes(NODES, answered, [], PROBE_TIMEOUT_S) == ["node1"]


def test_with_no_answer_yet_the_probe_waits_the_whole_timeout():
    # A slow controller and dead nodes look alike: a failed probe is no answer to measure the others by.
    assert silent_nodes(NODES, {}, ["node3"], PROBE_TIMEOUT_S - 0.05) is None
    assert silent_nodes(NODES, {}, ["node3"], PROBE_TIMEOUT_S) == ["node1", "node2", "node3"]


def test_the_result_keeps_the_nodes_order():
    assert silent_nodes(["b", "a", "c"], {"a": 0.1}, ["c"], PROBE_TIMEOUT_S) == ["b", "c"]


def test_srun_names_the_node_a_task_could_not_start_on():
    # As srun 22.05 printed it on the local cluster with a node's slurmd killed (24.11 words it the same).
    line = "srun: error: Task launch for StepId=206000.194 failed on node node17: Communication connection failure"
    assert launch_failed_node(line) == "node17"
    assert (
        launch_failed_node("srun: error: Application launch failed: Communication connection failure") is None
    )
    assert launch_failed_node("srun: error: node9: task 8: Killed") is None


class FakeSlurm:
    """srun's together-probe, sinfo's gone nodes and the per-node probe over a cluster whose `down` nodes slurmctld
    calls gone (it refuses any step that names one) and whose `dead` nodes it has not noticed yet."""

    def __init__(self, down: set[str] = frozenset(), dead: set[str] = frozenset()):
        self.down, self.dead = set(down), set(dead)
        self.calls: list[tuple[str, list[str]]] = []

    def together(self, nodes):
        self.calls.append(("together", list(nodes)))
        if self.down & set(nodes):
            return {}, [], True  # "Unable to create step ...: Requested node configuration is not available"
        dead = [n for n in nodes if n in self.dead]
        return (
            {n: 0.1 for n in nodes if n not in self.dead},
            dead[:1],
            True,
        )  # srun names the first failed launch

    def gone(self, nodes):
        self.calls.append(("gone", list(nodes)))
        return [n for n in nodes if n in self.down]

    def each(self, nodes):
        self.calls.append(("each", list(nodes)))
        return [n for n in nodes if n in self.down | self.dead]

    def probe(self, nodes):
        return unanswering(nodes, self.together, self.gone, self.each)


FLEET = [f"node{i}" for i in range(1, 2001)]


def test_a_node_slurmctld_calls_down_is_named_from_its_state_without_a_probe_per_node():
    slurm = FakeSlurm(down={"node17"})
    assert slurm.probe(FLEET) == ["node17"]
    # The refused step, sinfo, then the others together again: three calls, not 2,000 sruns.
    assert [kind for kind, _ in slurm.calls] == ["together", "gone", "together"]
    assert "node17" not in slurm.calls[2][1] and len(slurm.calls[2][1]) == 1999


def test_a_healthy_fleet_is_one_call_and_a_failed_launch_is_named_by_srun():
    slurm = FakeSlurm()
    assert slurm.probe(FLEET) == [] and len(slurm.calls) == 1
    slurm = FakeSlurm(dead={"node5"})
    assert slurm.probe(FLEET) == ["node5"] and len(slurm.calls) == 1


def test_nodes_left_unknown_that_slurmctld_does_not_call_gone_are_probed_one_by_one():
    slurm = FakeSlurm(dead={"node3", "node4"})  # srun names node3 only and ends: node4 is unknown
    assert slurm.probe(FLEET[:6]) == ["node3", "node4"]
    assert slurm.calls[1:] == [("gone", ["node4"]), ("each", ["node4"])]


def test_a_probe_still_waiting_calls_every_node_that_did_not_answer_silent():
    def together(nodes):
        return {"node1": 0.2}, [], False

    assert unanswering(["node1", "node2"], together, lambda _: [], lambda _: []) == ["node2"]


def test_a_srun_that_fails_at_once_has_ended_though_it_exits_after_closing_its_output(tmp_path, monkeypatch):
    """srun refusing the step ("Unable to create step": a node slurmctld calls DOWN) closes its pipes a moment before
    it exits. Read as still running, every node was called silent (seen 2 calls in 6 on the local cluster); it has
    ended, so the nodes are settled from their states. Here an `srun` on PATH closes its output, then exits 0.3 s
    later, as the real one does at random."""
    import os

    from hpkit.supervise.cluster import SlurmCli

    fake = tmp_path / "srun"
    fake.write_text(
        "#!/bin/bash\n"
        "echo 'srun: error: Unable to create step for job 7: Requested node configuration is not available' >&2\n"
        "exec >&- 2>&-\nsleep 0.3\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    answered, failed, ended = SlurmCli()._probe_together(["node1", "node2"])
    assert (answered, failed, ended) == ({}, [], True)
