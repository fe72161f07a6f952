"""hpkit-torchrun's decisions made before torch starts: who hosts the store, and torchrun's --rdzv-conf."""

from __future__ import annotations

import os
import signal

import pytest

from hpkit.torchrun_agent import done_key, hosts_store, with_is_host


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HPKIT_RDZV_NODE": "node1", "SLURMD_NODENAME": "node1"}, True),
        ({"HPKIT_RDZV_NODE": "node1", "SLURMD_NODENAME": "node2"}, False),
        ({"SLURMD_NODENAME": "node1"}, None),  # not rendered by hpkit: torchrun decides as it always does
        ({"HPKIT_RDZV_NODE": "node1"}, None),  # no Slurm node name (an OCI container): the same
        ({"HPKIT_RDZV_NODE": "", "SLURMD_NODENAME": "node1"}, None),
    ],
)
def test_only_the_named_node_hosts_the_store(env, expected):
    assert hosts_store(env) is expected


@pytest.mark.parametrize(
    ("conf", "is_host", "expected"),
    [
        ("", True, "is_host=true"),
        ("read_timeout=120", False, "read_timeout=120,is_host=false"),
        (
            "is_host=true,read_timeout=120",
            False,
            "read_timeout=120,is_host=false",
        ),  # the job script's choice wins
        (" is_host = 1 ,", True, "is_host=true"),
    ],
)
def test_rdzv_conf_carries_the_decision(conf, is_host, expected):
    assert with_is_host(conf, is_host) == expected


def test_each_rendezvous_counts_its_own_agents():
    assert done_key("5010") != done_key("5011")


def test_a_failed_worker_ends_the_agent_with_torchruns_table_and_no_traceback(monkeypatch, capsys):
    # In a job (HPKIT_RDZV_NODE set), a worker's failure prints torchrun's "Root Cause" table, which `hpkit why`
    # reads, and exits 1 as torchrun does, without the agent's own traceback above the job's real error.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hpkit import torchrun_agent
    from hpkit.jobs.why_scan import scan_output
    from hpkit.watch_store import STORE_ENV, STORE_NODE_ENV

    def failing(_args):
        raise ChildFailedError("train.py", {3: ProcessFailure(1, 4242, 3, "<N/A>")})  # global rank 3

    monkeypatch.setattr(torchrun_agent, "_run", failing)
    # main() wraps the agent's shutdown (stop_failed_workers_at_once): undone after the test as well.
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monkeypatch.setattr(LocalElasticAgent, "_shutdown", LocalElasticAgent._shutdown)
    # main() names the watch store in this process's environment for its workers: undone after the test, or every
    # later test of this worker (the hang drills) reports to a store that is not there.
    for name in (STORE_ENV, STORE_NODE_ENV):
        monkeypatch.setenv(name, "")  # records the variable's absence, which undo restores
    monkeypatch.setenv("HPKIT_RDZV_NODE", "node1")
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    argv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint"]
    with pytest.raises(SystemExit) as ended:
        torchrun_agent.main([*argv, "127.0.0.1:29999", "--rdzv-id", "7", "train.py"])
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Root Cause (first observed failure)" in err, err
    found = scan_output(err.splitlines(True), "job.out")
    (root,) = [f for f in found if f.kind == "launcher_root"]
    assert (root.rank, root.exit_code) == (3, 3), root
    # And the node the rank ran on, in the agent's own line: srun's task lines cannot say it under torchrun.
    (placed,) = [f for f in found if f.kind == "rank_failed_on"]
    assert (placed.rank, placed.node) == (3, "node2"), placed
    assert os.environ[STORE_ENV] == "127.0.0.1:29999"  # named during the test; monkeypatch removes it after


def test_the_agent_stops_its_workers_at_once_after_a_failure_and_with_torchruns_grace_on_a_signal():
    """A rank whose peer died is blocked in a collective and cannot act on SIGTERM: after a failure (no signal
    came) the agent SIGKILLs its workers FAILED_STOP_S after SIGTERM, not torchrun's 30 s; a signal the agent
    was sent (Slurm's USR1 or SIGTERM, passed on to the ranks to checkpoint and stop) keeps torchrun's timeout, and so
    does a hang the watchdog called (its ranks write their stacks, then exit by themselves)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from hpkit.job_events import HANG_EXIT
    from hpkit.torchrun_agent import FAILED_STOP_S, stop_failed_workers_at_once

    class Proc:
        def __init__(self, code: int | None) -> None:
            self.code = code

        def poll(self) -> int | None:
            return self.code

    class Handler:
        def __init__(self, code: int | None) -> None:
            self.proc = Proc(code)

    class Workers:  # the agent's process context: its workers' processes, and what it is asked to close with
        def __init__(self, *codes: int | None) -> None:
            self.closed: list[tuple[signal.Signals, float]] = []
            self.subprocess_handlers = {rank: Handler(code) for rank, code in enumerate(codes)}

        def close(self, death_sig: signal.Signals, timeout: float) -> None:
            self.closed.append((death_sig, timeout))

    original = LocalElasticAgent._shutdown
    try:
        stop_failed_workers_at_once()
        stop_failed_workers_at_once()  # twice (a second launch in one process) wraps once
        agent = object.__new__(LocalElasticAgent)
        agent._worker_watchdog = agent._health_check_server = None
        agent._pcontext = workers = Workers(None, 1)  # one worker failed, one runs (blocked)
        agent._shutdown(timeout=30)  # the agent's `finally`: its run failed (or ended)
        try:
            raise SignalException("got signal", sigval=signal.SIGUSR1)
        except SignalException as exc:
            agent._shutdown(exc.sigval, timeout=30)  # the agent's `except SignalException`
        assert workers.closed == [(signal.SIGTERM, FAILED_STOP_S), (signal.SIGUSR1, 30)]
        # A worker ended by the hang watchdog: the others write their stacks and exit by themselves.
        agent._pcontext = hang = Workers(None, HANG_EXIT)
        agent._shutdown(timeout=30)
        assert hang.closed == [(signal.SIGTERM, 30)]
    finally:
        LocalElasticAgent._shutdown = original


@pytest.mark.parametrize("cause", ["child_failed", "signal_alone"])
def test_a_signal_while_torchrun_closes_after_its_rank_failed_still_reports_that_rank(
    monkeypatch, capsys, cause
):
    """As in a CI run: this node's rank was SIGKILLed, and while torchrun closed the rendezvous (in its `finally`),
    srun's SIGTERM came (a peer's agent had exited first): the SignalException was raised while handling the
    ChildFailedError, and the agent died of it with a traceback, naming neither the rank's node nor its signal. A
    signal with no failure behind it (a stop, a preemption) is torchrun's as before."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hpkit import torchrun_agent

    def failing(_args):
        try:
            if cause == "child_failed":
                raise ChildFailedError("train.py", {1: ProcessFailure(0, 4242, -9, "<N/A>")})
        finally:  # torchrun's rendezvous shutdown, where the signal came
            raise SignalException("Process 10863 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun_agent, "_run", failing)
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    if cause == "signal_alone":
        with pytest.raises(SignalException):
            torchrun_agent._run_reporting(None)
        return
    assert torchrun_agent._run_reporting(None) == 137
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Root Cause (first observed failure)" in err, err
    assert "hpkit-torchrun: rank 1 failed on node1 (exit code -9)" in err.splitlines(), err


@pytest.mark.parametrize(("exitcode", "status"), [(-9, 137), (-11, 139), (1, 1), (3, 1)])
def test_the_agent_exits_128_plus_the_signal_that_killed_its_first_failed_rank(exitcode, status):
    """srun reports the agent's status: a rank SIGKILLed reads as 137, which the job's supervisor restarts where
    every node answers (hpkit.supervise.cluster.TaskExit.killed); a rank's own failure stays torchrun's 1."""
    from hpkit.supervise.cluster import TaskExit
    from hpkit.torchrun_agent import failed_status

    assert failed_status(exitcode) == status
    assert TaskExit("node1", "0", f"Exited with exit code {status}").killed == (exitcode == -9)
