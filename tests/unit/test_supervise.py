"""The job supervisor's state machine (hpkit.supervise.machine) against a scripted cluster.

Every Slurm call goes through one boundary (hpkit.supervise.cluster.Cluster); here a fake plays the steps a
case scripts (their exits, srun's per-task errors, a hang verdict the watchdog would write) and the nodes'
answers, and records what the supervisor asked. The real cluster runs the same machine in
tests/integration (test_hang_recovery.py, test_node_loss.py, test_resilience.py, test_why_jobs.py).
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hpkit import job_events as ev
from hpkit.supervise.cluster import TaskExit
from hpkit.supervise.machine import POLL_S, STEP_GRACE_S, Supervisor
from hpkit.supervise.plan import Plan, Run

JOB = "77"


@dataclass
class StepScript:
    """One step as a case plays it: it runs `polls` polls, then exits `exit` (at once when killed)."""

    exit: int = 0
    polls: int = 1
    tasks: list[TaskExit] = field(default_factory=list)
    agent_lines: list[str] = field(default_factory=list)  # what its torchrun agents printed (hpkit-torchrun)
    on_start: Callable[[int], None] | None = None  # given the attempt; e.g. writes a hang verdict
    exit_on_usr1: int | None = None  # exits with this once it gets USR1
    # After this many polls its `ranks` ranks have installed their signal handlers and say so, as hpkit train's do
    ready_after: int | None = None
    ranks: int = 2
    # A zygote's step (resilience.warm_start): node -> the polls after which its zygote says it serves
    serves_after: dict[str, int] = field(default_factory=dict)


class FakeStep:
    def __init__(self, script: StepScript, cluster: FakeCluster):
        self.script, self.cluster = script, cluster
        self.polls = script.polls
        self.signals: list[int] = []
        self.signalled_after: list[int] = []  # how many polls the step had run at each signal
        self.status: int | None = None
        self.env: dict[str, str] = {}
        self.ready_when: Callable[[str], str | None] | None = None
        self.killed_at: float | None = None  # the cluster's clock when the supervisor killed the step

    def poll(self) -> int | None:
        if self.status is None:
            if self.script.polls - self.polls == self.script.ready_after:
                from hpkit.supervise.ready import announce

                for rank in range(self.script.ranks):
                    announce(self.env, rank, self.script.ranks)
            self.polls -= 1
            if self.polls <= 0:
                self.status = self.script.exit
        return self.status

    def join(self, timeout: float) -> None:
        if self.cluster.polls_wait_for_probe:
            # The supervisor probes on a thread of its own; a real step's polls take real time, this one's none,
            # so a case about what follows the probe lets it finish first (on a loaded machine too).
            self.cluster.probed.wait(5)
        self.cluster.sleep(timeout)

    def ready(self) -> set[str]:
        if self.ready_when is None:
            return set()
        from hpkit.warm.protocol import ready_line

        # What the real step does: each zygote's line, read by the supervisor's own parser.
        done = self.script.polls - self.polls
        lines = [
            ready_line(n, 1.0, "torch", 1) for n, after in self.script.serves_after.items() if done >= after
        ]
        return {name for line in lines if (name := self.ready_when(line))}

    def task_exits(self) -> list[TaskExit]:
        return list(self.script.tasks)

    def failed_ranks(self) -> list[ev.RankFailed]:
        # The real step's parser over the agents' lines.
        return [r for line in self.script.agent_lines if (r := ev.parse_rank_failed_line(line))]

    def staying_ranks(self) -> list[ev.RankStays]:
        return [r for line in self.script.agent_lines if (r := ev.parse_stays_line(line))]

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        self.signalled_after.append(self.script.polls - self.polls)
        if signum == signal.SIGUSR1 and self.script.exit_on_usr1 is not None:
            self.polls, self.script.exit = 1, self.script.exit_on_usr1

    def kill(self) -> None:
        self.status = 137
        self.killed_at = self.cluster.clock

    def end(self, grace_s: float) -> None:
        self.signal(signal.SIGTERM)
        self.join(grace_s)
        if self.poll() is None:
            self.kill()

    def wait(self) -> int:
        while self.poll() is None:
            pass
        assert self.status is not None
        return self.status


class FakeCluster:
    def __init__(self, steps: list[StepScript], nodes: Sequence[str] = ("node1", "node2")):
        self.scripts = list(steps)
        self.nodes = list(nodes)
        self.unanswering_nodes: set[str] = set()  # probes of these fail
        self.down: set[str] = set()  # sinfo calls these down
        self.answer = True
        self.calls: list[str] = []
        self.started: list[tuple[list[str], dict[str, str], FakeStep]] = []
        self.started_at: list[float] = []  # the clock at each start_step
        self.clock = 0.0
        self.probed = threading.Event()  # set once unanswering has answered
        self.polls_wait_for_probe = False  # a step's polls wait (real time) until then
        # A stopped step's rendezvous store listens until the clock reaches this (None: never)
        self.store_listens_s: float | None = None

    def start_step(
        self,
        srun_args: Sequence[str],
        env: Mapping[str, str],
        ready_when: Callable[[str], str | None] | None = None,
    ) -> FakeStep:
        step = FakeStep(self.scripts.pop(0), self)
        step.env, step.ready_when = dict(env), ready_when
        self.started_at.append(self.clock)
        self.started.append((list(srun_args), dict(env), step))
        if step.script.on_start is not None:
            step.script.on_start(int(env["HPKIT_STEP_ATTEMPT"]))
        return step

    def unanswering(self, nodes: Sequence[str]) -> list[str]:
        self.calls.append(f"probe {','.join(nodes)}")
        silent = [n for n in nodes if n in self.unanswering_nodes]
        self.probed.set()
        return silent

    def all_answer(self, node_count: int) -> bool:
        return self.answer

    def lost_nodes(self, nodelist: str, states: str) -> list[str]:
        return sorted(self.down)

    def hostnames(self, nodelist: str) -> list[str]:
        return list(self.nodes)

    def node_addr(self, node: str) -> str:
        return f"10.0.0.{node[-1]}"

    def slurmd_timeout(self) -> int:
        return 10

    def set_requeue(self, job_id: str, on: bool) -> bool:
        self.calls.append(f"requeue flag {int(on)}")
        return True

    def requeue(self, job_id: str) -> bool:
        self.calls.append(f"scontrol requeue {job_id}")
        return True

    def replace_node(self, node: str) -> bool:
        self.calls.append(f"replace {node}")
        return True

    def cancel_steps(self, job_id: str) -> None:
        self.calls.append("cancel steps")

    def listens(self, addr: str, port: int) -> bool:
        self.calls.append(f"listens {addr}:{port}")
        return self.store_listens_s is not None and self.clock < self.store_listens_s

    def hyperpod(self) -> bool:
        return True

    def monotonic(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        self.clock += seconds


def plan(**fields) -> Plan:
    base = dict(
        max_restarts=2,
        requeue_on_failure=True,
        spare_nodes=0,
        nodes=2,
        step_tasks=2,
        tasks_per_node=1,
        replace_bad_nodes=False,
        launcher="torchrun",
        output_dir="logs",
        hangs_dir="logs/hangs",
        lost_node_states="^(down|fail)|[*]$",
    )
    return Plan(**{**base, **fields})


@dataclass
class Outcome:
    exit: int
    lines: list[str]
    events: list[dict]
    cluster: FakeCluster
    supervisor: Supervisor


def supervise(
    tmp_path: Path,
    cluster: FakeCluster,
    restart: int = 0,
    batch_host: str = "node1",
    usr1_flag: Path | None = None,
    **plan_fields,
) -> Outcome:
    (tmp_path / "logs").mkdir(exist_ok=True)
    lines: list[str] = []
    run = Run(job_id=JOB, restart=restart, nodelist="node[1-3]", batch_host=batch_host, cwd=tmp_path)
    sup = Supervisor(
        plan(**plan_fields),
        run,
        cluster,
        ["--kill-on-bad-exit=1"],
        "hpkit train",
        {},
        lines.append,
        usr1_flag,
    )
    status = sup.run()
    return Outcome(status, lines, events(tmp_path), cluster, sup)


def events(tmp_path: Path) -> list[dict]:
    path = ev.events_path(tmp_path / "logs", JOB)
    return [e for _, _, e in ev.read(path.read_text().splitlines())] if path.exists() else []


def of(outcome: Outcome, kind: str) -> list[dict]:
    return [e for e in outcome.events if e["type"] == kind]


def hang_at(
    tmp_path: Path, restart: int = 0, culprit: str | None = None, judge: str | None = None
) -> Callable[[int], None]:
    """What the watchdog leaves when it stops a hung step (hpkit.runtime.watchdog.hang_watchdog's layout); `judge`:
    the node whose watchdog wrote it."""

    def write(attempt: int) -> None:
        folder = tmp_path / "logs" / "hangs" / f"{JOB}-{restart}-{attempt}-0-step5"
        folder.mkdir(parents=True)
        (folder / "culprit_nodes").write_text(f"{culprit}\n" if culprit else "")
        record = {"line": "hpkit: hang: rank 1", "culprits": [1], **({"judge": judge} if judge else {})}
        (folder / "verdict.json").write_text(json.dumps(record))

    return write


def test_a_hang_restarts_the_step_in_the_allocation(tmp_path):
    cluster = FakeCluster([StepScript(exit=75, on_start=hang_at(tmp_path)), StepScript(exit=0)])
    out = supervise(tmp_path, cluster)
    assert out.exit == 0
    restart = of(out, ev.RESTART)
    assert len(restart) == 1 and restart[0]["reason"] == "hang" and restart[0]["budget_left"] == 1
    assert restart[0]["verdict"].endswith(f"{JOB}-0-0-0-step5/verdict.json")
    assert [e["attempt"] for e in of(out, ev.STEP_STARTED)] == [0, 1]
    assert [env["HPKIT_STEP_ATTEMPT"] for _, env, _ in cluster.started] == ["0", "1"]
    assert "scontrol requeue 77" not in cluster.calls
    assert of(out, ev.END)[0]["outcome"] == ev.COMPLETED
    # Every event names its job, run and attempt, and when it happened.
    for event in out.events:
        assert {"type", "time", "job", "restart", "attempt"} <= set(event), event


def test_a_lost_node_is_swapped_for_a_spare_and_the_step_restarts_on_it(tmp_path):
    cluster = FakeCluster(
        [
            StepScript(exit=1, polls=100, tasks=[TaskExit("node1", "0", "Killed")]),
            StepScript(exit=0),
        ],
        nodes=["node1", "node2", "node3"],
    )
    cluster.unanswering_nodes = {"node1"}
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1)
    assert out.exit == 0
    # The batch host is the spare; the step runs on the others, rendezvous on the first.
    first_argv, first_env, first = cluster.started[0]
    assert "--nodelist=node1,node2" in first_argv and "--overlap" not in first_argv
    assert first_env["MASTER_ADDR"] == "10.0.0.1" and first_env["HPKIT_RDZV_NODE"] == "node1"
    # The failing step was stopped after its grace, not waited for.
    assert first.status == 137 and "cancel steps" in cluster.calls
    # When the fault was seen, once, with what srun had said by then (a recovery's detection ends there).
    (failing,) = of(out, ev.STEP_FAILING)
    assert failing["tasks"] == [{"node": "node1", "tasks": "0", "outcome": "Killed", "exit_code": None}]
    assert failing["verdict"] is None and failing["time"] <= of(out, ev.STEP_ENDED)[0]["time"]
    swap = of(out, ev.SPARE_SWAP)
    assert swap == [{**swap[0], "node": "node1", "spare": "node3", "spares_left": []}]
    second_argv, second_env, _ = cluster.started[1]
    assert "--nodelist=node3,node2" in second_argv and "--overlap" in second_argv
    assert second_env["MASTER_ADDR"] == "10.0.0.3"
    assert of(out, ev.RESTART)[0]["reason"] == "node"
    assert of(out, ev.PROBE)[0]["unanswering"] == ["node1"]
    ended = of(out, ev.STEP_ENDED)[0]
    assert ended["tasks"] == [{"node": "node1", "tasks": "0", "outcome": "Killed", "exit_code": None}]
    assert "scontrol requeue 77" not in cluster.calls


def test_sagemaker_hosts_are_each_steps_nodes_rendezvous_node_first_and_never_a_spare(tmp_path):
    """sagemaker_env: a SageMaker script's world is len(SM_HOSTS) and its rank is the index of its node there, and its
    rank 0 serves the store at MASTER_ADDR. The allocation's list (the batch script's before) named the spare, so the
    script waited for a host that had no task, and after a swap it still named the lost node."""
    cluster = FakeCluster(
        [StepScript(exit=1, polls=100, tasks=[TaskExit("node1", "0", "Killed")]), StepScript(exit=0)],
        nodes=["node1", "node2", "node3"],
    )
    cluster.unanswering_nodes = {"node1"}
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1, sagemaker_hosts=True)
    assert out.exit == 0
    hosts = [json.loads(env["SM_HOSTS"]) for _, env, _ in cluster.started]
    assert hosts == [["node1", "node2"], ["node3", "node2"]], hosts
    for (_, env, _), step_hosts in zip(cluster.started, hosts, strict=True):
        assert env["MASTER_ADDR"] == cluster.node_addr(step_hosts[0]), env
    # A job without sagemaker_env gets no SM_HOSTS.
    plain = FakeCluster([StepScript(exit=0)], nodes=["node1", "node2"])
    (tmp_path / "plain").mkdir()
    supervise(tmp_path / "plain", plain)
    assert "SM_HOSTS" not in plain.started[0][1]


@pytest.mark.parametrize("silent", [True, False])
def test_a_failing_step_with_a_silent_node_is_stopped_without_waiting_out_the_grace(tmp_path, silent):
    # The probe starts when the step begins to fail; a node that does not answer cannot finish the step, so the
    # step is stopped as soon as the probe says so. Where every node answers, the step keeps its grace (it may end
    # by itself, with its ranks' own exit statuses).
    task = TaskExit("node1", "0", "Killed") if silent else TaskExit("node1", "0", "Exited with exit code 1")
    cluster = FakeCluster(
        [StepScript(exit=1, polls=100, tasks=[task]), StepScript(exit=0)], nodes=["node1", "node2", "node3"]
    )
    cluster.unanswering_nodes = {"node1"} if silent else set()
    cluster.polls_wait_for_probe = True
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1)
    killed_at = cluster.started[0][2].killed_at
    assert killed_at is not None
    if silent:
        assert killed_at < STEP_GRACE_S
        assert "hpkit: the step is failing and node(s) node1 do not answer: stopping it" in out.lines
        assert out.exit == 0 and of(out, ev.SPARE_SWAP)[0]["node"] == "node1"
    else:
        assert killed_at >= STEP_GRACE_S
        assert "hpkit: the step is failing and still running 3 s later: stopping it" in out.lines


@pytest.mark.parametrize("swapped", [False, True])
def test_a_restarted_step_starts_once_the_stopped_steps_store_on_its_node_has_closed(tmp_path, swapped):
    # The stopped step's agent on the rendezvous node may still be ending, its store listening: a new agent there
    # could not bind the port, and the others would join the old store. With another rendezvous node (its first
    # node swapped out), nothing is waited for.
    task = TaskExit("node1" if swapped else "node2", "0", "Killed")
    cluster = FakeCluster(
        [StepScript(exit=1, polls=100, tasks=[task]), StepScript(exit=0)], nodes=["node1", "node2", "node3"]
    )
    cluster.unanswering_nodes = {task.node}
    cluster.store_listens_s = 4.0
    lines: list[str] = []
    run = Run(job_id=JOB, restart=0, nodelist="node[1-3]", batch_host="node3", cwd=tmp_path)
    (tmp_path / "logs").mkdir()
    sup = Supervisor(
        plan(spare_nodes=1), run, cluster, [], "hpkit train", {"MASTER_PORT": "29577"}, lines.append
    )
    assert sup.run() == 0
    assert cluster.started[0][1]["MASTER_ADDR"] == "10.0.0.1"
    if swapped:
        assert cluster.started[1][1]["MASTER_ADDR"] == "10.0.0.3"
        assert not [c for c in cluster.calls if c.startswith("listens")]
        return
    assert cluster.started[1][1]["MASTER_ADDR"] == "10.0.0.1"
    assert cluster.started_at[1] >= 4.0
    assert (
        "hpkit: the stopped step's rendezvous store still listens on 10.0.0.1:29577: waiting for it to close"
        in lines
    )


def test_spares_are_taken_in_order_and_the_batch_host_is_the_last(tmp_path):
    # node4 runs this supervisor: while another spare is left, a bad node's place goes to that one, so that
    # losing a training node never takes the batch host (and the supervisor) into the steps.
    cluster = FakeCluster(
        [StepScript(exit=75, on_start=hang_at(tmp_path, culprit="node1")), StepScript(exit=0)],
        nodes=["node1", "node2", "node3", "node4"],
    )
    out = supervise(tmp_path, cluster, batch_host="node4", spare_nodes=2)
    assert out.exit == 0
    assert of(out, ev.RUN_STARTED)[0]["spares"] == ["node3", "node4"]
    swap = of(out, ev.SPARE_SWAP)
    assert [(e["node"], e["spare"], e["spares_left"]) for e in swap] == [("node1", "node3", ["node4"])]
    assert "--nodelist=node3,node2" in cluster.started[1][0]


def test_the_batch_host_is_a_spare_where_slurm_puts_it_first(tmp_path):
    # Slurm's batch host is usually the allocation's first node: it still goes last, behind the steps' nodes.
    cluster = FakeCluster([StepScript(exit=0)], nodes=["node1", "node2", "node3"])
    out = supervise(tmp_path, cluster, batch_host="node1", spare_nodes=1)
    assert out.exit == 0
    started = of(out, ev.RUN_STARTED)[0]
    assert (started["step_nodes"], started["spares"]) == (["node2", "node3"], ["node1"])
    assert "--nodelist=node2,node3" in cluster.started[0][0]


def test_a_verdict_judged_on_a_node_that_does_not_answer_swaps_only_that_node(tmp_path):
    # node1's link cut, and node1 held the watchdog's store: its judge saw node2 go silent and named it (issue 44's
    # cut-link bench). The probe finds node1 alone unanswering: node2 is healthy, keeps its place, is not replaced.
    cluster = FakeCluster(
        [
            StepScript(exit=75, polls=100, on_start=hang_at(tmp_path, culprit="node2", judge="node1")),
            StepScript(exit=0),
        ],
        nodes=["node1", "node2", "node3", "node4"],
    )
    cluster.unanswering_nodes = {"node1"}
    out = supervise(tmp_path, cluster, batch_host="node4", spare_nodes=2, replace_bad_nodes=True)
    assert out.exit == 0
    swap = of(out, ev.SPARE_SWAP)
    assert [(e["node"], e["spare"], e["spares_left"]) for e in swap] == [("node1", "node3", ["node4"])]
    assert "--nodelist=node3,node2" in cluster.started[1][0]
    assert "replace node2" not in cluster.calls
    assert of(out, ev.RESTART)[0]["reason"] == "node"
    assert any(
        "judged on node node1, which does not answer: its culprit node(s) node2 stay" in x for x in out.lines
    )


def test_replace_bad_nodes_asks_hyperpod_to_replace_the_swapped_node(tmp_path):
    cluster = FakeCluster(
        [StepScript(exit=75, on_start=hang_at(tmp_path, culprit="node2")), StepScript(exit=0)],
        nodes=["node1", "node2", "node3"],
    )
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1, replace_bad_nodes=True)
    assert out.exit == 0 and "replace node2" in cluster.calls
    assert of(out, ev.REPLACE_ASKED)[0]["node"] == "node2"
    assert of(out, ev.RESTART)[0]["reason"] == "hang"


def test_a_lost_node_with_no_spare_left_requeues_the_job(tmp_path):
    def lose_node2(_attempt: int) -> None:
        cluster.unanswering_nodes.add("node2")

    cluster = FakeCluster(
        [
            StepScript(exit=1, tasks=[TaskExit("node1", "0", "Killed")]),
            StepScript(exit=1, tasks=[TaskExit("node2", "1", "Killed")], on_start=lose_node2),
        ],
        nodes=["node1", "node2", "node3"],
    )
    cluster.unanswering_nodes = {"node1"}
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1, max_restarts=3)
    assert out.exit == 0
    assert cluster.calls[-1] == "scontrol requeue 77"
    requeue = of(out, ev.REQUEUE)
    assert requeue[0]["reason"] == "no_spare" and requeue[0]["to_restart"] == 1
    assert requeue[0]["budget_left"] == 1  # a swap and a requeue: two of three
    runs = ev.runs_path(tmp_path / "logs", JOB).read_text()
    assert runs.splitlines()[-1] == "requeued-by-hpkit 1"


def test_usr1_during_a_step_is_passed_on_and_requeues(tmp_path):
    flag = tmp_path / "usr1"
    cluster = FakeCluster([StepScript(exit=0, polls=4, exit_on_usr1=0, on_start=lambda _: flag.touch())])
    out = supervise(tmp_path, cluster, usr1_flag=flag)
    assert out.exit == 0
    assert cluster.started[0][2].signals == [signal.SIGUSR1]
    assert of(out, ev.USR1) and of(out, ev.REQUEUE)[0]["reason"] == "usr1"
    assert cluster.calls[-1] == "scontrol requeue 77"
    assert json.loads(ev.budget_path(tmp_path / "logs", JOB).read_text())["used"] == 1


def test_a_usr1_that_came_during_set_up_reaches_the_step(tmp_path):
    flag = tmp_path / "usr1"
    flag.touch()
    cluster = FakeCluster([StepScript(exit=0, polls=50, exit_on_usr1=0)])
    out = supervise(tmp_path, cluster, usr1_flag=flag, requeue_on_failure=False)
    assert cluster.started[0][2].signals == [signal.SIGUSR1]
    # Not requeueable by Slurm (no --requeue): the flag goes on for hpkit's own requeue only.
    assert cluster.calls[-2:] == ["requeue flag 1", "scontrol requeue 77"]
    assert out.exit == 0


def test_a_program_failing_on_healthy_nodes_is_not_requeued(tmp_path):
    cluster = FakeCluster([StepScript(exit=3, tasks=[TaskExit("node2", "1", "Exited with exit code 3")])])
    out = supervise(tmp_path, cluster)
    assert out.exit == 3
    assert not any("requeue" in call for call in cluster.calls)
    end = of(out, ev.END)[0]
    assert end["outcome"] == ev.PROGRAM_FAILED and end["exit"] == 3
    assert of(out, ev.STEP_ENDED)[0]["tasks"][0]["exit_code"] == 3


def test_a_program_failing_with_spares_and_answering_nodes_uses_no_spare(tmp_path):
    cluster = FakeCluster(
        [StepScript(exit=3, tasks=[TaskExit("node1", "0", "Exited with exit code 3")])],
        nodes=["node1", "node2", "node3"],
    )
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1)
    assert out.exit == 3 and not of(out, ev.SPARE_SWAP)
    assert of(out, ev.END)[0]["outcome"] == ev.PROGRAM_FAILED


@pytest.mark.parametrize(
    ("spare_nodes", "killed"),
    [
        (1, TaskExit("node1", "0", "Exited with exit code 137")),  # hpkit-torchrun: its rank died of SIGKILL
        (0, TaskExit("node2", "1", "Killed")),  # srun: the rank itself was SIGKILLed
    ],
)
def test_a_sigkilled_rank_on_answering_nodes_restarts_the_step_on_the_same_nodes(
    tmp_path, spare_nodes, killed
):
    """The OOM killer or an operator killed a rank; its node answers: the step restarts in the allocation (from
    memory, where checkpoint.memory holds it), on the same nodes, paid from the budget; no spare is taken."""
    survivor = TaskExit("node2" if killed.node == "node1" else "node1", "x", "Exited with exit code 1")
    cluster = FakeCluster(
        [StepScript(exit=1, polls=100, tasks=[killed, survivor]), StepScript(exit=0)],
        nodes=["node1", "node2", "node3"],
    )
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=spare_nodes)
    assert out.exit == 0 and not of(out, ev.SPARE_SWAP)
    (restart,) = of(out, ev.RESTART)
    assert restart["reason"] == "killed" and restart["budget_left"] == 1
    first, second = (argv for argv, _, _ in cluster.started)
    assert [a for a in first if a.startswith("--nodelist")] == [
        a for a in second if a.startswith("--nodelist")
    ]
    assert any(
        f"a rank was killed (SIGKILL: task {killed.tasks} on {killed.node})" in line for line in out.lines
    )


@pytest.mark.parametrize("spare_nodes", [0, 1])
def test_a_sigkilled_rank_whose_agent_srun_never_reported_restarts_the_step_from_the_agent_s_line(
    tmp_path, spare_nodes
):
    """Under torchrun, node2's agent exited 1 (its rank lost its peer) and srun killed node1's (--kill-on-bad-exit)
    before reporting its 137: only node1's agent's own line says its rank 1 died of SIGKILL, as in a CI run."""
    survivor = TaskExit("node2", "1", "Exited with exit code 1")
    agent = ev.rank_failed_line(1, "node1", -9)
    for lines, restarts in (([agent], 1), ([ev.rank_failed_line(1, "node1", 1)], 0), ([], 0)):
        cluster = FakeCluster(
            [StepScript(exit=1, polls=100, tasks=[survivor], agent_lines=lines), StepScript(exit=0)],
            nodes=["node1", "node2", "node3"],
        )
        (case := tmp_path / f"{len(lines)}-{restarts}").mkdir()
        out = supervise(case, cluster, batch_host="node3", spare_nodes=spare_nodes)
        assert len(of(out, ev.RESTART)) == restarts, (lines, out.lines)
        if restarts:
            assert out.exit == 0
        else:  # no SIGKILL said: the program's own failure, as before
            assert of(out, ev.END)[0]["outcome"] == ev.PROGRAM_FAILED
    cluster = FakeCluster(
        [StepScript(exit=1, polls=100, tasks=[survivor], agent_lines=[f"0: {agent}"]), StepScript(exit=0)],
        nodes=["node1", "node2", "node3"],
    )
    (tmp_path / "labelled").mkdir()
    out = supervise(tmp_path / "labelled", cluster, batch_host="node3", spare_nodes=spare_nodes)
    assert any(
        "a rank was killed (SIGKILL: rank 1 on node1) and every node answers" in line for line in out.lines
    )


def test_an_agents_rank_line_starts_the_failing_steps_grace_before_srun_reports_a_task(tmp_path):
    """torchrun's agent prints its rank's failure, then closes the rendezvous (seconds, on a loaded cluster) before
    it exits and srun says so: with spares, the step's grace and the probe start from the agent's line. Without it
    they waited for srun's task line, here never (the step ran until it ended by itself)."""
    lines = [f"1: {ev.rank_failed_line(1, 'node2', 1)}"]
    cluster = FakeCluster(
        [StepScript(exit=1, polls=100, agent_lines=lines), StepScript(exit=0)],
        nodes=["node1", "node2", "node3"],
    )
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1)
    (failing,) = of(out, ev.STEP_FAILING)
    assert failing["ranks"] == [{"rank": 1, "node": "node2", "exit_code": 1}] and failing["tasks"] == [], (
        failing
    )
    # Stopped after the grace, not when the step ended by itself (100 polls).
    assert cluster.started[0][2].status == 137 and "cancel steps" in cluster.calls


def test_a_sigkilled_rank_with_no_restart_left_ends_the_job_as_the_programs_failure(tmp_path):
    cluster = FakeCluster([StepScript(exit=137, tasks=[TaskExit("node1", "0", "Exited with exit code 137")])])
    out = supervise(tmp_path, cluster, max_restarts=0)
    assert out.exit == 137 and not of(out, ev.RESTART)
    assert of(out, ev.END)[0]["outcome"] == ev.PROGRAM_FAILED


def test_a_lost_node_without_spares_is_left_to_slurm(tmp_path):
    cluster = FakeCluster([StepScript(exit=1)])
    cluster.down = {"node2"}
    out = supervise(tmp_path, cluster)
    lost = of(out, ev.NODE_LOST)[0]
    assert lost["nodes"] == ["node2"] and lost["then"] == "requeued"
    assert not any("requeue" in call for call in cluster.calls)  # slurmctld requeues, not hpkit
    assert of(out, ev.END)[0]["outcome"] == ev.NODE_LOST_UNHANDLED


def test_a_spent_budget_ends_the_job_and_names_the_budget(tmp_path):
    cluster = FakeCluster(
        [StepScript(exit=75, on_start=hang_at(tmp_path)), StepScript(exit=75, on_start=hang_at(tmp_path))]
    )
    out = supervise(tmp_path, cluster, max_restarts=1)
    assert out.exit == 75
    end = of(out, ev.END)[0]
    assert end["outcome"] == ev.HANG_BUDGET_SPENT and end["budget_left"] == 0 and end["max_restarts"] == 1
    assert end["verdict"].endswith(f"{JOB}-0-1-0-step5/verdict.json")
    assert any("resilience.max_restarts=1" in line for line in out.lines), out.lines
    # The last restart spent: Slurm's own requeue is turned off, so a node failure cannot go past it.
    assert "requeue flag 0" in cluster.calls


def test_one_budget_across_a_requeue_and_restarts_in_the_allocation(tmp_path):
    """max_restarts 2, a hang on every attempt, a requeue between: exactly two restarts, then the end.

    (`restarts + attempt < max_restarts`, the old script's rule, allowed a third: restart 1 of the second run.)
    """
    flag = tmp_path / "usr1"
    first = FakeCluster(
        [
            StepScript(exit=75, on_start=hang_at(tmp_path, restart=0)),
            StepScript(exit=0, polls=5, exit_on_usr1=0, on_start=lambda _: flag.touch()),
        ]
    )
    out = supervise(tmp_path, first, usr1_flag=flag)
    assert out.exit == 0 and first.calls[-1] == "scontrol requeue 77"
    flag.unlink()
    second = FakeCluster([StepScript(exit=75, on_start=hang_at(tmp_path, restart=1))] * 3)
    out = supervise(tmp_path, second, restart=1, usr1_flag=flag)
    assert out.exit == 75
    restarts = [e for e in out.events if e["type"] in (ev.RESTART, ev.REQUEUE)]
    assert [(e["type"], e["restart"], e["budget_left"]) for e in restarts] == [
        (ev.RESTART, 0, 1),
        (ev.REQUEUE, 0, 0),
    ]
    assert len(second.started) == 1
    end = of(out, ev.END)[-1]
    assert end["outcome"] == ev.HANG_BUDGET_SPENT and end["restart"] == 1 and end["budget_left"] == 0
    assert of(out, ev.RUN_STARTED)[-1]["requeued_by"] == "hpkit"


def test_a_requeue_slurm_made_counts_against_the_budget(tmp_path):
    (tmp_path / "logs").mkdir()
    ev.runs_path(tmp_path / "logs", JOB).write_text("nodes node[1-2]\n")
    cluster = FakeCluster([StepScript(exit=0)])
    cluster.down = {"node2"}
    out = supervise(tmp_path, cluster, restart=1, max_restarts=1)
    started = of(out, ev.RUN_STARTED)[0]
    assert started["requeued_by"] == "slurm" and started["lost_nodes"] == ["node2"]
    assert started["budget_left"] == 0
    assert "requeue flag 0" in cluster.calls  # the last restart: a further node failure ends the job


def test_a_run_past_the_budget_runs_nothing(tmp_path):
    (tmp_path / "logs").mkdir()
    cluster = FakeCluster([])
    out = supervise(tmp_path, cluster, restart=3, max_restarts=2)
    assert out.exit == 1 and not cluster.started
    assert of(out, ev.END)[0]["outcome"] == ev.BUDGET_SPENT


@pytest.mark.parametrize("restart", [0, 1])
def test_without_requeue_on_failure_a_requeued_run_turns_slurms_requeue_off(tmp_path, restart):
    cluster = FakeCluster([StepScript(exit=0)])
    supervise(tmp_path, cluster, restart=restart, requeue_on_failure=False)
    assert ("requeue flag 0" in cluster.calls) == (restart == 1)


def test_the_rendered_script_hands_the_supervisor_its_plan():
    from hpkit.render import render, supervise_plan
    from hpkit.spec import JobSpec
    from hpkit.validation import parse_document

    spec = parse_document(
        JobSpec,
        {
            "name": "r",
            "nodes": 2,
            "resilience": {"max_restarts": 1, "spare_nodes": 1, "replace_bad_nodes": True},
        },
    )
    got = Plan.from_json(supervise_plan(spec))
    assert (got.max_restarts, got.spare_nodes, got.nodes, got.replace_bad_nodes) == (1, 1, 2, True)
    assert got.hangs_dir.endswith("/hangs")
    script = render(spec)
    assert "python3 -m hpkit.supervise --plan " in script
    # The template lays out; the supervisor decides: no restart logic is left in the script.
    for bash_logic in ("scontrol requeue", "Action:Replace", "sinfo", "verdict.json", "restarts +"):
        assert bash_logic not in script, bash_logic


def test_requeue_on_failure_and_spares_need_a_restart_budget():
    from hpkit.errors import SpecError
    from hpkit.render import render
    from hpkit.spec import JobSpec
    from hpkit.validation import parse_document

    with pytest.raises(SpecError, match="requeue_on_failure: true needs a restart budget"):
        parse_document(JobSpec, {"name": "r", "resilience": {"max_restarts": 0, "requeue_on_failure": True}})
    with pytest.raises(SpecError, match=r"spare_nodes: 1 needs a restart budget.*max_restarts > 0"):
        parse_document(JobSpec, {"name": "r", "resilience": {"max_restarts": 0, "spare_nodes": 1}})
    script = render(parse_document(JobSpec, {"name": "r", "resilience": {"max_restarts": 0}}))
    assert "#SBATCH --no-requeue" in script


# The rendered script and the real supervisor, with Slurm's commands faked: each appends its argv to $CALLS.
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"$CALLS"
case "$1 $2" in
  "show node")
    # Slurm's warning signal reaches the batch shell while the supervisor sets up (the shell is its parent):
    # the step's rendezvous address is the last thing it asks before it starts the step.
    [[ -n ${USR1_AT_SETUP:-} ]] && kill -USR1 "$(ps -o ppid= -p "$PPID" | tr -d ' ')"
    echo "NodeName=$4 NodeAddr=10.0.0.9" ;;
esac
"""
# The step: waits for the USR1 the supervisor passes on, then exits as ranks that saved and stopped do.
FAKE_SRUN = """#!/bin/bash
trap 'echo "srun got USR1" >>"$CALLS"; exit 0' USR1
echo "srun $*" >>"$CALLS"
for _ in $(seq 100); do sleep 0.1; done
exit 1
"""


def test_a_usr1_during_set_up_reaches_the_step_and_requeues_through_the_rendered_script(tmp_path):
    import os
    import subprocess
    import sys

    from hpkit.render import render
    from hpkit.spec import JobSpec
    from hpkit.validation import parse_document

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    spec = {"name": "u", "nodes": 2, "launcher": "srun", "command": ["true"], "output_dir": "out"}
    spec["resilience"] = {"max_restarts": 1}
    (tmp_path / "out").mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render(parse_document(JobSpec, spec)))
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "USR1_AT_SETUP": "1",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURMD_NODENAME": "node1",
        "TMPDIR": str(tmp_path),
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = calls.read_text().splitlines()
    # The supervisor passed the signal on at once: the step ended (the fake srun, as a real one does this
    # early, may die of it before its trap is set), and the job was requeued.
    assert seen[-1] == "scontrol requeue 42", seen
    events = [e for _, _, e in ev.read(ev.events_path(tmp_path / "out", "42").read_text().splitlines())]
    assert [e["type"] for e in events if e["type"] in ("usr1", "requeue")] == ["usr1", "requeue"], events
    assert [e["signalled"] for e in events if e["type"] == "step_ended"] == [True], events
    assert not list(tmp_path.glob("hpkit-usr1-*")), "the flag file is left behind"


def test_a_first_run_does_not_take_an_earlier_jobs_budget_with_the_same_id(tmp_path):
    (tmp_path / "logs").mkdir()
    ev.budget_path(tmp_path / "logs", JOB).write_text(
        '{"max_restarts": 2, "used": 2, "counted_runs": [1, 2]}'
    )
    cluster = FakeCluster([StepScript(exit=75, on_start=hang_at(tmp_path)), StepScript(exit=0)])
    out = supervise(tmp_path, cluster)
    assert out.exit == 0 and of(out, ev.RUN_STARTED)[0]["budget_left"] == 2


@pytest.mark.parametrize(
    ("launcher", "command", "serves"),
    [
        ("srun", ["python3", "-m", "hpkit", "train"], True),
        ("mpi", ["/venv/bin/hpkit", "train"], True),
        ("torchrun", ["hpkit", "train"], False),  # hpkit-torchrun serves it
        ("srun", ["python3", "my_script.py"], False),  # no watchdog: no torch in the batch step
    ],
)
def test_the_watch_store_is_served_for_hpkit_train_under_srun_and_mpi(launcher, command, serves):
    from hpkit.render import supervise_plan
    from hpkit.spec import JobSpec
    from hpkit.validation import parse_document

    spec = parse_document(JobSpec, {"name": "w", "launcher": launcher, "command": command})
    assert Plan.from_json(supervise_plan(spec)).watch_store is serves


def test_a_pending_usr1_is_held_until_every_rank_has_installed_its_handler(tmp_path):
    # USR1 came before the step started: passed at once, it killed ranks still setting up (its default action).
    # hpkit train's ranks say when their handlers are in place; the supervisor passes it then, once.
    flag = tmp_path / "usr1"
    flag.touch()
    cluster = FakeCluster([StepScript(exit=0, polls=50, exit_on_usr1=0, ready_after=3)])
    out = supervise(tmp_path, cluster, usr1_flag=flag, requeue_on_failure=False, ranks_ready=True)
    step = cluster.started[0][2]
    assert step.signals == [signal.SIGUSR1] and step.signalled_after == [
        4
    ]  # polled after the 3rd poll's announce
    assert "hpkit: USR1 held until the step's ranks have installed their signal handlers" in out.lines
    assert of(out, ev.REQUEUE)[0]["reason"] == "usr1"
    ready = Path(step.env["HPKIT_READY_DIR"])
    assert ready.parent == tmp_path / "logs" / ".ready" and not ready.exists()  # removed once the step ended
    # A step whose ranks never get there (they fail setting up) ends without the signal, and the job requeues.
    flag.touch()
    cluster = FakeCluster([StepScript(exit=1, polls=5)])
    out = supervise(tmp_path, cluster, usr1_flag=flag, requeue_on_failure=False, ranks_ready=True)
    assert cluster.started[0][2].signals == [] and of(out, ev.REQUEUE)[0]["reason"] == "usr1"


def test_a_usr1_is_held_for_ranks_that_never_say_they_are_ready_only_for_half_the_grace(tmp_path):
    """Ranks that never announce (one stuck setting up, a ready folder that cannot be written) kept the signal from
    every rank until Slurm's kill: no rank saved. After half of signal_grace_s it is passed on, once, and said."""
    flag = tmp_path / "usr1"
    flag.touch()
    cluster = FakeCluster([StepScript(exit=0, polls=10**4, exit_on_usr1=0)])
    out = supervise(
        tmp_path, cluster, usr1_flag=flag, requeue_on_failure=False, ranks_ready=True, usr1_hold_s=30
    )
    step = cluster.started[0][2]
    assert step.signals == [signal.SIGUSR1], step.signals
    # Polled every POLL_S on the cluster's clock, from the signal's arrival.
    assert 30 <= step.signalled_after[0] * POLL_S <= 31, step.signalled_after
    passed = [
        line for line in out.lines if line.startswith("hpkit: USR1 passed on 30 s after it came though")
    ]
    assert passed and passed[0].endswith("the job resumes from its last checkpoint"), out.lines
    assert of(out, ev.REQUEUE)[0]["reason"] == "usr1"
    # No restart left: the line does not promise a resume.
    (spent := tmp_path / "spent").mkdir()
    cluster = FakeCluster([StepScript(exit=0, polls=10**4, exit_on_usr1=0)])
    out = supervise(
        spent,
        cluster,
        usr1_flag=flag,
        requeue_on_failure=False,
        ranks_ready=True,
        usr1_hold_s=30,
        max_restarts=0,
    )
    passed = [
        line for line in out.lines if line.startswith("hpkit: USR1 passed on 30 s after it came though")
    ]
    assert passed and passed[0].endswith("no restart is left (resilience.max_restarts=0)"), out.lines
    # The rendered job holds it for half its grace.
    from hpkit.render import supervise_plan
    from hpkit.spec import JobSpec
    from hpkit.validation import parse_document

    spec = parse_document(
        JobSpec, {"name": "g", "command": ["hpkit", "train"], "resilience": {"signal_grace_s": 300}}
    )
    assert Plan.from_json(supervise_plan(spec)).usr1_hold_s == 150


def test_warm_start_keeps_one_zygote_step_over_every_node_for_the_run(tmp_path):
    """resilience.warm_start: one background step with a task on each node of the allocation, spares included, and
    --no-kill (slurmctld then ends only a lost node's task: the survivors' zygotes stay), started before the first
    training step and ended (SIGTERM) when the run ends. One srun, not one per node."""
    zygotes = StepScript(polls=10**6, serves_after={"node1": 1, "node2": 1, "node3": 1})
    cluster = FakeCluster([zygotes, StepScript(exit=0)], nodes=["node1", "node2", "node3"])
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1, warm="python -m hpkit.warm.zygote")
    assert out.exit == 0
    (argv, env, step), (train_argv, _, _) = cluster.started
    assert argv[2] == 'exec srun "$@" python -m hpkit.warm.zygote'
    wanted = {"--overlap", "--job-name=hpkit-warm", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1"}
    assert wanted | {"--nodelist=node[1-3]", "--no-kill", "--kill-on-bad-exit=0"} <= set(argv), argv
    assert "HPKIT_STEP_ATTEMPT" not in env
    assert step.signals == [signal.SIGTERM]
    assert "--nodelist=node1,node2" in train_argv


def test_the_first_step_waits_until_the_zygote_of_each_of_its_nodes_serves(tmp_path):
    """Its ranks fork too (one import per node, not one per rank and agent): the first step starts once the
    zygotes of its nodes have said they serve, not before; a spare's zygote is not waited for."""
    zygotes = StepScript(polls=10**6, serves_after={"node1": 3, "node2": 20})
    cluster = FakeCluster([zygotes, StepScript(exit=0)], nodes=["node1", "node2", "node3"])
    out = supervise(tmp_path, cluster, batch_host="node3", spare_nodes=1, warm="python -m hpkit.warm.zygote")
    assert out.exit == 0
    from hpkit.warm.protocol import ready_line, ready_node

    # The supervisor knows a zygote serves by its line (one format, one parser: hpkit.warm.protocol).
    assert cluster.started[0][2].ready_when is ready_node
    assert ready_node("3: " + ready_line("node2", 4.21, "torch", 1)) == "node2"
    assert cluster.started_at[1] == pytest.approx(2.0)  # node2 serves at its 20th poll, 0.1 s apart
    assert "hpkit: warm starts: every zygote serves after 2.0 s: the first step's ranks fork" in out.lines


@pytest.mark.parametrize("late", [True, False])
def test_a_zygote_that_is_late_or_ended_leaves_its_node_cold_and_the_first_step_goes_on(tmp_path, late):
    from hpkit.supervise.machine import WARM_READY_S

    ended = [] if late else [TaskExit("node2", "1", "Exited with exit code 1")]
    zygotes = StepScript(polls=10**6, serves_after={"node1": 1}, tasks=ended)
    cluster = FakeCluster([zygotes, StepScript(exit=0)])
    out = supervise(tmp_path, cluster, warm="python -m hpkit.warm.zygote")
    assert out.exit == 0
    if late:
        assert cluster.started_at[1] == pytest.approx(WARM_READY_S, abs=0.2)
        assert (
            "hpkit: warm starts: the zygote on node2 is late after 120 s: its first ranks start cold"
            in out.lines
        )
    else:
        assert cluster.started_at[1] < 1.0
        assert "hpkit: warm starts: the zygote on node2 ended: its first ranks start cold" in out.lines


def test_no_warm_start_no_zygote_step(tmp_path):
    cluster = FakeCluster([StepScript(exit=0)])
    out = supervise(tmp_path, cluster)
    assert out.exit == 0 and len(cluster.started) == 1


# Stands in for srun: a task's exit line, then on SIGTERM what srun says when it stops a step (measured on 22.05).
# Unbuffered writes: the SIGTERM can land while the first line's flush has not yet returned (the reader has the
# line, the writer is still in the call), and a handler writing through the same buffered stderr then fails with
# "reentrant call" and exit 1, as it did once in a loaded run.
_SRUN_LIKE = """
import os, signal, time
def stop(*_):
    os.write(2, b"srun: forcing job termination\\nsrun: error: node2: task 1: Killed\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
os.write(2, b"srun: error: node1: task 0: Exited with exit code 3\\n")
time.sleep(60)
"""


def test_a_step_ended_on_purpose_passes_on_its_lines_until_then_and_not_srun_s_lines_about_the_stop(capfd):
    """The zygotes' step ends when the run does: srun then says "forcing job termination" and "task N: Killed" for
    each node, after the job's log has said it completed (the demo's, once its ranks started warm). Those lines are
    the stop, not a fault: they are not passed on; the step's earlier lines are, and its task exits are still kept."""
    import sys
    import time

    from hpkit.supervise.cluster import _SrunStep

    step = _SrunStep([sys.executable, "-c", _SRUN_LIKE], {"PATH": "/usr/bin:/bin"})
    deadline = time.monotonic() + 60
    while not step.task_exits():  # the reader has passed on the first line
        assert time.monotonic() < deadline, "the step's first line never came"
        time.sleep(0.01)
    step.end(30)
    assert step.wait() == 0
    err = capfd.readouterr().err
    assert "task 0: Exited with exit code 3" in err
    assert "forcing job termination" not in err and "Killed" not in err, err
    assert [t.node for t in step.task_exits()] == ["node1", "node2"]


def test_the_step_keeps_what_the_torchrun_agents_say_of_their_failed_ranks():
    """srun passes each task's stderr on: the supervisor's reader keeps the agents' rank lines (the real formatter's)
    beside srun's own task lines."""
    import sys

    from hpkit.supervise.cluster import _SrunStep

    lines = [ev.rank_failed_line(1, "node1", -9), "srun: error: node2: task 1: Exited with exit code 1"]
    program = f"import sys; sys.stderr.write({chr(10).join(lines) + chr(10)!r}); sys.exit(1)"
    step = _SrunStep([sys.executable, "-c", program], {"PATH": "/usr/bin:/bin"})
    assert step.wait() == 1
    step._reader.join(30)
    assert step.failed_ranks() == [ev.RankFailed(1, "node1", -9)]
    assert [(t.node, t.exit_code) for t in step.task_exits()] == [("node2", 1)]


@pytest.mark.parametrize("spare_nodes", [0, 1])
def test_a_rank_that_stays_in_its_process_starts_the_failing_steps_grace(tmp_path, spare_nodes):
    """resilience.keep_survivors: a rank whose group broke stays parked and its task does not end, so its line
    (hpkit train's own formatter, srun's label before it) starts the grace, spares or not, and the step is stopped
    and restarted (a SIGKILLed peer's task). Without keep_survivors and spares, nothing watches the step: it runs
    until it ends by itself (here after 100 polls), which a parked rank's never does."""
    stays = f"1: {ev.stays_line(1, 'node2', 4242, 'its process group broke (Connection closed by peer)')}"
    killed = TaskExit("node1", "0", "Killed")
    for keep, stopped in ((True, True), (False, bool(spare_nodes))):
        cluster = FakeCluster(
            [StepScript(exit=1, polls=100, agent_lines=[stays], tasks=[killed]), StepScript(exit=0)],
            nodes=["node1", "node2", "node3"],
        )
        (case := tmp_path / f"{keep}").mkdir()
        out = supervise(case, cluster, batch_host="node3", spare_nodes=spare_nodes, keep_survivors=keep)
        assert (cluster.started[0][2].status == 137) == stopped, (keep, out.lines)
        if keep:
            (failing,) = of(out, ev.STEP_FAILING)
            assert failing["stays"] == [{"rank": 1, "node": "node2", "pid": 4242}], failing
        assert len(of(out, ev.RESTART)) == 1 and out.exit == 0, out.lines


def test_a_step_whose_every_rank_ended_or_stays_is_stopped_without_its_grace(tmp_path):
    """keep_survivors: rank 0 died of SIGKILL (its agent's line) and rank 1 stays in its process: nothing more will
    come, so the step is stopped at once, not STEP_GRACE_S later. With rank 0 unaccounted for (under torchrun srun's
    task line names the agent, not the rank), after the grace."""
    stays = f"1: {ev.stays_line(1, 'node2', 4242, 'its process group broke (Connection closed by peer)')}"
    killed = TaskExit("node1", "0", "Killed")
    for lines, at_once in (([ev.rank_failed_line(0, "node1", -9), stays], True), ([stays], False)):
        cluster = FakeCluster(
            [StepScript(exit=1, polls=100, agent_lines=lines, tasks=[killed]), StepScript(exit=0)],
            nodes=["node1", "node2", "node3"],
        )
        (case := tmp_path / str(at_once)).mkdir()
        out = supervise(case, cluster, batch_host="node3", spare_nodes=1, keep_survivors=True, ranks=2)
        step = cluster.started[0][2]
        assert step.killed_at is not None
        assert (step.killed_at - cluster.started_at[0] < STEP_GRACE_S) == at_once, (at_once, step.killed_at)
        assert any("every rank of the step has ended or stays" in line for line in out.lines) == at_once
        assert len(of(out, ev.RESTART)) == 1 and out.exit == 0, out.lines


def test_srun_task_ids_expand_as_srun_writes_them():
    assert TaskExit("node1", "0,2-3", "Killed").task_ids == [0, 2, 3]
    assert TaskExit("node1", "5", "Exited with exit code 1").task_ids == [5]
