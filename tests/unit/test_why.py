"""`hpkit why`: the rule (hpkit.jobs.why.decide) and the line scanners (hpkit.jobs.why_scan) on log snippets in
the exact formats of real jobs on the local cluster (torch 2.13, Slurm 22.05): the exception, SIGKILL, hang,
OOM and cancel ones are such jobs' logs trimmed; the others are assembled from lines those jobs print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.jobs import why
from hpkit.jobs.why import Facts, SlurmRecord, decide
from hpkit.jobs.why_scan import (
    scan_events,
    scan_hang_verdict,
    scan_jobcomp,
    scan_metrics,
    scan_output,
    scan_scontrol,
    scan_slurm_log,
)

REPO = Path(__file__).resolve().parents[2]

# srun launcher, 2 nodes x 2 ranks: rank 2 raises; ranks 1 and 3 then fail in their all_reduce.
EXCEPTION_SRUN = """\
hpkit: job 19820 (restart 0 of at most 0) on node[1-2], rendezvous 127.0.0.1:49320
3: step 1 ok
2: step 2 ok
2: [rank2]: Traceback (most recent call last):
2: [rank2]:   File "/work/hpkit/python/hpkit/run_script.py", line 46, in main
2: [rank2]:     runpy.run_path(script, run_name="__main__")
2: [rank2]:   File "/tmp/w/raise_on_rank.py", line 20, in main
2: [rank2]:     x = load_batch(step, rank)
2: [rank2]:         ^^^^^^^^^^^^^^^^^^^^^^
2: [rank2]:   File "/tmp/w/raise_on_rank.py", line 12, in load_batch
2: [rank2]:     raise ValueError(f"corrupt sample in batch {step}")
1: [rank1]: Traceback (most recent call last):
2: [rank2]: ValueError: corrupt sample in batch 3
1: [rank1]:   File "/tmp/w/raise_on_rank.py", line 21, in main
1: [rank1]:     dist.all_reduce(x)
1: [rank1]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
1: [rank1]:     work.wait()
1: [rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19342. This is typically caused by a remote worker crashing.
srun: error: node2: task 2: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=19820.0
0: slurmstepd-node1: error: *** STEP 19820.0 ON node1 CANCELLED AT 2026-11-25T11:25:43 ***
srun: error: node2: task 3: Terminated
srun: error: node1: tasks 0-1: Terminated
hpkit: the training program failed on healthy nodes (exit 143); not requeued
"""

# torchrun, 2 nodes x 1 rank: rank 1 was SIGKILLed; rank 0's "Connection reset" comes first in the file.
SIGKILL_TORCHRUN = """\
hpkit: job 19821 (restart 0 of at most 0) on node[1-2], rendezvous 127.0.0.1:49321
0: step   176 | loss 2.4650 | grad_norm 1.065 | lr 1.00e-02 | 2,423 tok/s
0: [rank0]: Traceback (most recent call last):
0: [rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4394, in all_gather_single
0: [rank0]:     work.wait()
0: [rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32146: Connection reset by peer. This is typically caused by a remote worker hanging
E1125 11:26:21.804000 31868 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 31899) of binary: /venv/bin/python
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 6, in <module>
    sys.exit(main())
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
/venv/bin/python FAILED
------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_11:26:21
  host      : node2
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 31899)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 31899
======================================================
srun: error: node2: task 1: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=19821.0
slurmstepd-node1: error: *** STEP 19821.0 ON node1 CANCELLED AT 2026-11-25T11:26:22 ***
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 31865 got signal: 15
srun: error: node1: task 0: Exited with exit code 1
hpkit: the training program failed on healthy nodes (exit 1); not requeued
"""

HANG_DIR = "/w/logs/hangs/19822-0-0-0-step6"
# torchrun: the watchdog names rank 1; torchrun's "first observed failure" is rank 0's exit 75.
HANG = f"""\
hpkit: job 19822 (restart 0 of at most 0) on node[1-2], rendezvous 127.0.0.1:49322
1: hpkit: fault injected (HPKIT_FAULT): hang on rank 1 before step 6
0: hpkit: hang: rank 1 on node2 held up step 6 for 6 s (limit 5 s): it has not entered the collective the other ranks wait in at /hpkit/runtime/watchdog/faults.py:67 in before_step; stacks of every rank in {HANG_DIR}
E1125 11:28:20.876000 644 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 75) local_rank: 0 (pid: 767) of binary: /venv/bin/python
Root Cause (first observed failure):
[0]:
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 75 (pid: 767)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
srun: error: node1: task 0: Exited with exit code 1
srun: error: node2: task 1: Exited with exit code 1
hpkit: the step hung ({HANG_DIR}) and the restart budget (resilience.max_restarts=0) is spent: ending the job
"""
HANG_VERDICT_JSON = json.dumps(
    {
        "step": 5,
        "culprits": [1],
        "reason": "behind",
        "nodes": {"0": "node1", "1": "node2"},
        "top_frames": {"1": "/hpkit/runtime/watchdog/faults.py:67 in before_step"},
        "line": "hpkit: hang: rank 1 on node2 held up step 6 for 6 s (limit 5 s): it has not entered the "
        "collective the other ranks wait in at /hpkit/runtime/watchdog/faults.py:67 in before_step",
        "stacks": HANG_DIR,
    },
    indent=1,
)

# The batch host survived: the surviving rank's peer closed its connection, then the script saw the lost node.
NODE_LOST = """\
hpkit: job 7002 (restart 0 of at most 0) on node[1-2], rendezvous 127.0.0.1:36502
0: [rank0]: Traceback (most recent call last):
0: [rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
0: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40655
srun: error: node1: task 0: Exited with exit code 1
hpkit: the step ended (exit 1) after node(s) node2 stopped answering: resilience.requeue_on_failure is off, so Slurm ends the job as NODE_FAIL
slurmstepd-node1: error: *** JOB 7002 ON node1 CANCELLED AT 2026-11-25T12:00:41 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***
"""

# jobacct_gather/linux with OverMemoryKill (the dev cluster's MEMORY_KILL=1).
OOM = """\
hpkit: job 19810 (restart 0 of at most 0) on node1, rendezvous 127.0.0.1:49310
slurmstepd-node1: error: StepId=19810.0 exceeded memory limit (199548928 > 104857600), being killed
slurmstepd-node1: error: Exceeded job memory limit
srun: Job step aborted: Waiting up to 7 seconds for job step to finish.
srun: error: node1: task 0: Killed
hpkit: the training program failed on healthy nodes (exit 137); not requeued
"""

TIME_LIMIT = """\
hpkit: job 7004 (restart 0 of at most 0) on node[1-2], rendezvous 127.0.0.1:36504
hpkit: USR1 received: asking the ranks to checkpoint and stop
slurmstepd-node1: error: *** JOB 7004 ON node1 CANCELLED AT 2026-11-25T11:29:34 DUE TO TIME LIMIT ***
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
torch.distributed.elastic.multiprocessing.api.SignalException: Process 31865 got signal: 15
srun: error: node1: task 0: Terminated
"""

CANCELLED = """\
hpkit: job 19824 (restart 0 of at most 3) on node1, rendezvous 127.0.0.1:49324
srun: Job step aborted: Waiting up to 7 seconds for job step to finish.
0: slurmstepd-node1: error: *** STEP 19824.0 ON node1 CANCELLED AT 2026-11-25T11:28:16 ***
slurmstepd-node1: error: *** JOB 19824 ON node1 CANCELLED AT 2026-11-25T11:28:16 ***
srun: error: node1: task 0: Terminated
"""
SLURMCTLD = """\
[2026-11-25T11:28:08.401] _slurm_rpc_submit_batch_job: JobId=19824 InitPrio=4294901753 usec=476
[2026-11-25T11:28:09.150] sched: Allocate JobId=198240 NodeList=node1 #CPUs=1 Partition=dev
[2026-11-25T11:28:16.969] _slurm_rpc_kill_job: REQUEST_KILL_JOB JobId=198240 uid 1000
[2026-11-25T11:28:16.969] _slurm_rpc_kill_job: REQUEST_KILL_JOB JobId=19824 uid 0
"""

REQUEUED_USR1 = """\
hpkit: job 7006 (restart 0 of at most 3) on node1, rendezvous 127.0.0.1:36506
hpkit: USR1 received: asking the ranks to checkpoint and stop
0: hpkit train: stopping at step 41 on signal 10
hpkit: requeueing job 7006 (restart 1 of 3); it resumes from its last checkpoint
"""

# Two runs in one file (open-mode append): the first ended with a traceback and a lost node, the second completed.
TWO_RUNS = """\
hpkit: job 7007 (restart 0 of at most 2) on node[1-2], rendezvous 127.0.0.1:36507
1: [rank1]: Traceback (most recent call last):
1: [rank1]:   File "/w/train.py", line 9, in <module>
1: [rank1]: KeyError: 'tokens'
hpkit: the step ended (exit 1) after node(s) node2 stopped answering: Slurm requeues the job, which resumes from its last checkpoint
hpkit: job 7007 (restart 1 of at most 2) on node[1,3], rendezvous 127.0.0.1:36507
hpkit: restart 1: Slurm requeued the job after a node failure: node(s) node2 of the previous run (node[1-2]) are down
0: hpkit train: resumed from /ckpt/step-00000010 at step 10
0: hpkit train: done steps=20 final_loss=4.1 tokens_per_s=900 world=2
"""


EVENTS = "/w/logs/.hpkit-1.events.jsonl"


def event(kind: str, restart: int = 0, attempt: int = 0, **fields) -> dict:
    """One of the supervisor's events (hpkit.job_events), as it writes them."""
    return {"time": 1.0, "type": kind, "job": "1", "restart": restart, "attempt": attempt, **fields}


def events_text(events: list[dict]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def facts(
    text: str, records=(), extra=(), torchrun=None, source="/w/logs/job.out", events=(), start_line=1
) -> Facts:
    """Findings as hpkit.jobs.why_gather makes them: the output from the last step's line on, then the events."""
    findings = scan_output(text.splitlines(keepends=True), source, start_line)
    if events:
        findings += scan_events(events_text(list(events)).splitlines(keepends=True), EVENTS).findings
    return Facts("1", list(records), [*findings, *extra], [], torchrun)


def record(state: str, **fields) -> SlurmRecord:
    return SlurmRecord(source="scontrol show job 1", state=state, **fields)


def assert_cited(verdict: why.Verdict, text: str, source: str = "/w/logs/job.out") -> None:
    """Every evidence line from `source` is that line of `text`."""
    lines = text.splitlines()
    cited = [e for e in verdict.evidence if e.source == source]
    assert cited, verdict.evidence
    for e in cited:
        assert lines[e.line - 1] == e.text, e


def test_the_first_ranks_exception_wins_over_its_peers_connection_errors():
    v = decide(facts(EXCEPTION_SRUN, [record("FAILED", exit_code="143:0")]))
    assert v.kind == why.PROGRAM_ERROR and v.rank == 2 and v.node == "node2"
    assert (
        v.summary
        == "program error on rank 2: ValueError: corrupt sample in batch 3 (/tmp/w/raise_on_rank.py:12)"
    )
    assert v.evidence[0].text == "2: [rank2]: ValueError: corrupt sample in batch 3"
    assert 'File "/tmp/w/raise_on_rank.py", line 12' in v.evidence[1].text
    assert "srun: error: node2: task 2: Exited with exit code 1" in [e.text for e in v.evidence]
    assert_cited(v, EXCEPTION_SRUN)


def test_without_a_launcher_record_the_first_non_follow_on_traceback_wins():
    text = "\n".join(line for line in EXCEPTION_SRUN.splitlines() if not line.startswith("srun: error"))
    lines = text.splitlines()
    # the peer's error first in the file
    peer = [x for x in lines if x.startswith("1: ")]
    own = [x for x in lines if not x.startswith("1: ")]
    reordered = "\n".join([own[0], *peer, *own[1:]]) + "\n"
    v = decide(facts(reordered))
    assert v.kind == why.PROGRAM_ERROR and v.rank == 2, v.summary
    assert_cited(v, reordered)


def test_a_sigkilled_rank_beats_the_survivors_earlier_connection_reset():
    v = decide(facts(SIGKILL_TORCHRUN, [record("FAILED", exit_code="1:0")], torchrun=True))
    assert v.kind == why.SIGNAL and v.rank == 1 and v.node == "node2"
    assert v.summary == "killed by signal 9 (SIGKILL) on rank 1 (node2)"
    texts = [e.text for e in v.evidence]
    assert "  traceback : Signal 9 (SIGKILL) received by PID 31899" in texts
    assert "  rank      : 1 (local_rank: 0)" in texts
    assert not any("Connection reset" in t for t in texts)
    assert_cited(v, SIGKILL_TORCHRUN)


# Each node's torchrun prints its own block: here node2's (rank 0 died of the reset connection, a second later)
# reached the file before node1's (rank 1, SIGKILLed), as in a CI run of test_why_jobs.
SIGKILL_TWO_BLOCKS = """\
hpkit: job 5803 (restart 0 of at most 0) on node[1-2]
0: step     5 | loss 5.1813 | grad_norm 0.749 | lr 3.00e-04 | 729 tok/s
E1130 02:54:14.930000 13446 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 13499) of binary: /venv/bin/python3
0: [rank0]: Traceback (most recent call last):
0: [rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4943, in reduce_scatter_single
0: [rank0]:     work.wait()
0: [rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55986: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.
E1130 02:54:15.592000 13442 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 13500) of binary: /venv/bin/python3
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_02:54:15
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 13500)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_02:54:14
  host      : localhost
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 13499)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 13499
======================================================
srun: error: node1: task 0: Exited with exit code 137
srun: error: node2: task 1: Exited with exit code 1
hpkit: the training program failed on healthy nodes (exit 137); not requeued
"""


def test_the_job_s_first_failure_is_the_earliest_block_that_is_not_a_consequence_whatever_the_file_order():
    v = decide(facts(SIGKILL_TWO_BLOCKS, [record("FAILED", exit_code="137:0")], torchrun=True))
    assert (v.kind, v.rank, v.node) == (why.SIGNAL, 1, "node1"), v.summary
    # Both blocks in the same second: rank 0's reset connection still sets its block aside.
    same_second = SIGKILL_TWO_BLOCKS.replace("2026-11-30_02:54:15", "2026-11-30_02:54:14")
    v = decide(facts(same_second, [record("FAILED", exit_code="137:0")], torchrun=True))
    assert (v.kind, v.rank) == (why.SIGNAL, 1), v.summary
    # The same blocks with rank 0's traceback gone: no consequence left to set aside, so the earlier time decides.
    lines = [line for line in SIGKILL_TWO_BLOCKS.splitlines(True) if "[rank0]" not in line]
    v = decide(facts("".join(lines), [record("FAILED", exit_code="137:0")], torchrun=True))
    assert (v.kind, v.rank) == (why.SIGNAL, 1), v.summary


# resilience.keep_survivors: rank 0 (node2) stayed in its process when rank 1 (node1) was SIGKILLed. Its agent's block
# (exit 86, hpkit.warm.protocol.STAYED_EXIT, no traceback) is the earlier one here, as srun may interleave them.
STAYED_TWO_BLOCKS = """\
hpkit: job 6621 (restart 0 of at most 0) on node[1-2]
0: step     5 | loss 5.1813 | grad_norm 0.749 | lr 3.00e-04 | 729 tok/s
0: hpkit train: rank 0 on node2 stays in process 4535 for the next step: its process group broke ([/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12212: Connection reset by peer.)
hpkit-torchrun: rank 0 failed on node2 (exit code 86)
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_13:56:22
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 86 (pid: 4508)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
hpkit-torchrun: rank 1 failed on node1 (exit code -9)
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_13:56:23
  host      : localhost
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 4507)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4507
=====================================================
srun: error: node2: task 1: Exited with exit code 1
srun: error: node1: task 0: Exited with exit code 137
hpkit: the training program failed on healthy nodes (exit 137); not requeued
"""

# The same under srun's own launch (task id = rank): rank 1's client exits 86 once its rank stays, and srun may
# report that task before the SIGKILLed one.
STAYED_SRUN = """\
hpkit: job 6622 (restart 0 of at most 0) on node[1-2]
1: hpkit train: rank 1 on node2 stays in process 4535 for the next step: its process group broke (Connection closed by peer)
srun: error: node2: task 1: Exited with exit code 86
srun: error: node1: task 0: Killed
hpkit: the training program failed on healthy nodes (exit 137); not requeued
"""


@pytest.mark.parametrize("text, torchrun", [(STAYED_TWO_BLOCKS, True), (STAYED_SRUN, False)])
def test_a_rank_that_stayed_in_its_process_is_never_the_first_failure(text, torchrun):
    """Its launcher's exit (86) comes without a traceback and may come first: the verdict is the killed rank's."""
    v = decide(facts(text, [record("FAILED", exit_code="137:0")], torchrun=torchrun))
    expected = (why.SIGNAL, 1, "node1") if torchrun else (why.SIGNAL, 0, "node1")
    assert (v.kind, v.rank, v.node) == expected, v.summary
    assert not any("exit code 86" in e.text or "stays in process" in e.text for e in v.evidence), v.evidence


def test_the_killed_rank_s_node_is_the_task_whose_exit_says_the_signal_whatever_srun_s_order():
    # srun reported node2's agent (exit 1: its rank died of the reset connection) before node1's (137: it passed the
    # SIGKILL on), as in a CI run of test_why_jobs: the verdict named node2 for rank 1, which ran on node1.
    first, second = (
        "srun: error: node1: task 0: Exited with exit code 137\n",
        "srun: error: node2: task 1: Exited with exit code 1\n",
    )
    swapped = SIGKILL_TWO_BLOCKS.replace(first + second, second + first)
    assert swapped != SIGKILL_TWO_BLOCKS
    v = decide(facts(swapped, [record("FAILED", exit_code="137:0")], torchrun=True))
    assert (v.kind, v.rank, v.node) == (why.SIGNAL, 1, "node1"), v.summary
    killed = swapped.replace("task 0: Exited with exit code 137", "task 0: Killed")
    v = decide(facts(killed, [record("FAILED", exit_code="137:0")], torchrun=True))
    assert v.node == "node1", v.summary


def test_the_killed_rank_s_node_is_the_agent_s_word_when_srun_never_reports_that_node_s_agent():
    # srun reported node2's agent (exit 1) and killed node1's (--kill-on-bad-exit) before that one's exit was
    # reported, as in a CI run of test_why_jobs: no task line says the signal, and the verdict named node2 for rank 1.
    agent_line = "hpkit-torchrun: rank 1 failed on node1 (exit code -9)\n"
    only_node2 = SIGKILL_TWO_BLOCKS.replace("srun: error: node1: task 0: Exited with exit code 137\n", "")
    assert only_node2 != SIGKILL_TWO_BLOCKS
    v = decide(facts(only_node2, [record("FAILED", exit_code="1:0")], torchrun=True))
    assert v.node == "node2", "the log without the agent's line: only srun's word"
    # Nor does plain torchrun print that line; on a cluster its block's host is the node's name, which srun's lines use.
    on_hosts = only_node2.replace(
        "  host      : localhost\n  rank      : 1", "  host      : node1\n  rank      : 1"
    )
    assert on_hosts != only_node2
    on_hosts += "srun: error: node1: task 0: Exited with exit code 1\n"
    v = decide(facts(on_hosts, [record("FAILED", exit_code="1:0")], torchrun=True))
    assert (v.kind, v.rank, v.node) == (why.SIGNAL, 1, "node1"), v.summary
    srun_line = "srun: error: node2: task 1: Exited with exit code 1\n"
    with_agent = only_node2.replace(srun_line, agent_line + srun_line)
    assert with_agent.count(agent_line) == 1
    v = decide(facts(with_agent, [record("FAILED", exit_code="1:0")], torchrun=True))
    assert (v.kind, v.rank, v.node) == (why.SIGNAL, 1, "node1"), v.summary
    assert v.summary == "killed by signal 9 (SIGKILL) on rank 1 (node1)"
    assert agent_line.strip() in [e.text for e in v.evidence]
    # Another rank's line says nothing about rank 1; nor does a line when srun started every rank (no agent).
    other = only_node2.replace(srun_line, agent_line.replace("rank 1", "rank 0") + srun_line)
    assert decide(facts(other, [record("FAILED", exit_code="1:0")], torchrun=True)).node == "node2"


def test_srun_killed_task_is_the_signal_when_srun_started_every_rank():
    text = "hpkit: job 5 (restart 0 of at most 0) on node[1-2], rendezvous x:1\nsrun: error: node2: task 3: Killed\n"
    text += "srun: error: node1: tasks 0-2: Terminated\n"
    v = decide(facts(text, torchrun=False))
    assert (v.kind, v.rank, v.node) == (why.SIGNAL, 3, "node2"), v.summary


def test_a_hang_verdict_beats_the_exit_75_that_torchrun_reports_first():
    verdict = scan_hang_verdict(HANG_VERDICT_JSON, f"{HANG_DIR}/verdict.json", restart=0)
    v = decide(facts(HANG, [record("FAILED", exit_code="1:0", restarts=0)], extra=[verdict], torchrun=True))
    assert v.kind == why.HANG and v.rank == 1 and v.node == "node2"
    assert v.summary.startswith("hang: rank 1 on node2 held up step 6")
    assert "faults.py:67 in before_step" in v.summary and v.summary.endswith(f"; stacks in {HANG_DIR}")
    json_line = next(e for e in v.evidence if e.source.endswith("verdict.json"))
    assert HANG_VERDICT_JSON.splitlines()[json_line.line - 1] == json_line.text
    assert_cited(v, HANG)


# The causes the rule weighs before the program's own failure, in its order (hpkit.jobs.why's docstring), each
# as its lines read in a job's output; the hang and the node failure come with their files (verdict, events).
CAUSES = [
    why.HANG,
    why.NODE_FAILURE,
    why.OUT_OF_MEMORY,
    why.TIME_LIMIT,
    why.PREEMPTED,
]
CAUSE_LINES = {
    why.HANG: HANG.split("\n", 1)[1],
    why.NODE_FAILURE: "",  # its event (NODE_LOST_EVENTS)
    why.OUT_OF_MEMORY: (
        "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=19822.0. Some of your processes may have "
        "been killed by the cgroup out-of-memory handler.\nsrun: error: node1: task 0: Killed\n"
    ),
    why.TIME_LIMIT: "slurmstepd: error: *** JOB 19822 ON node1 CANCELLED AT 2026-11-25T11:00:00 DUE TO TIME LIMIT ***\n",
    why.PREEMPTED: "slurmstepd: error: *** JOB 19822 ON node1 CANCELLED AT 2026-11-25T11:00:00 DUE TO PREEMPTION ***\n",
}


@pytest.mark.parametrize("first", range(len(CAUSES) - 1))
def test_when_causes_mix_the_earlier_in_the_rules_order_wins_whatever_the_file_order(first):
    """A job that hung, lost a node, ran out of memory and was preempted: the hang is the verdict; without the
    hang, the node failure (the OOM killer's SIGKILL and the survivors' errors follow from it); and so on. Each
    later cause's lines come earlier in the output, so the file's order cannot give the rule's."""
    present = CAUSES[first:]
    header = HANG.split("\n", 1)[0] + "\n"
    text = header + "".join(CAUSE_LINES[c] for c in reversed(present))
    extra = (
        [scan_hang_verdict(HANG_VERDICT_JSON, f"{HANG_DIR}/verdict.json", restart=0)]
        if why.HANG in present
        else []
    )
    events = NODE_LOST_EVENTS if why.NODE_FAILURE in present else ()
    for cause in present:  # each alone gives its own verdict: the mix is what is tested
        alone = facts(
            header + CAUSE_LINES[cause],
            extra=extra if cause == why.HANG else [],
            torchrun=True,
            events=NODE_LOST_EVENTS if cause == why.NODE_FAILURE else (),
        )
        assert decide(alone).kind == cause
    v = decide(facts(text, [record("FAILED", exit_code="1:0")], extra=extra, torchrun=True, events=events))
    assert v.kind == CAUSES[first], v.summary


def test_a_store_verdict_names_the_stores_node():
    record = {
        "step": 6,
        "culprits": [0, 1],
        "reason": "store",
        "nodes": {"0": "node1", "1": "node1"},
        "store": "10.0.0.1:29500",
        "store_node": "node1",
        "reporter": "node2",
        "line": "hpkit: hang: the watchdog's store on node node1 (10.0.0.1:29500) has not answered node node2",
        "stacks": HANG_DIR,
    }
    found = scan_hang_verdict(json.dumps(record, indent=1), f"{HANG_DIR}/verdict.json", restart=0)
    assert found is not None and (found.rank, found.node) == (None, "node1")


RESTARTED = [
    event("run_started", nodes="node[1-2]", hangs_dir="/w/logs/hangs", launcher="torchrun"),
    event("restart", reason="hang", verdict=f"{HANG_DIR}/verdict.json", budget_left=0, max_restarts=1),
]


def test_a_hang_restarted_in_the_allocation_is_not_the_verdict():
    # The supervisor restarted the step after the hang: the new attempt's lines start after the old one's.
    restart_line = len(HANG.splitlines())
    later = HANG + "0: hpkit train: done steps=20 final_loss=4.1\n"
    completed = facts(
        later, [record("COMPLETED", exit_code="0:0")], events=RESTARTED, start_line=restart_line
    )
    assert decide(completed).kind == why.COMPLETED
    # With the restarted hang's verdict at hand, the completed job still names the hang and its node.
    verdict = scan_hang_verdict(HANG_VERDICT_JSON, f"{HANG_DIR}/verdict.json", restart=0)
    named = decide(
        facts(
            later,
            [record("COMPLETED", exit_code="0:0")],
            extra=[verdict],
            events=RESTARTED,
            start_line=restart_line,
        )
    )
    assert named.kind == why.COMPLETED and (named.rank, named.node) == (verdict.rank, verdict.node), named
    assert named.summary.startswith("completed; the step hung and was restarted in the allocation (hang: ")
    assert verdict.node in named.summary
    # restarted, and the new attempt then failed on its own: not a hang
    failing = HANG + "srun: error: node2: task 1: Exited with exit code 3\n"
    verdict = scan_hang_verdict(HANG_VERDICT_JSON, f"{HANG_DIR}/verdict.json", restart=0)
    v = decide(
        facts(
            failing,
            [record("FAILED", restarts=0)],
            extra=[verdict],
            torchrun=False,
            events=RESTARTED,
            start_line=restart_line,
        )
    )
    assert (v.kind, v.rank, v.summary) == (
        why.PROGRAM_ERROR,
        1,
        "program error on rank 1: exit code 3, no traceback",
    )


def test_an_earlier_runs_hang_verdict_is_not_the_verdict_of_a_requeued_run():
    """Run 0 hung (its verdict stays in the hangs folder) and was requeued; run 1 failed on its own."""
    verdict = scan_hang_verdict(HANG_VERDICT_JSON, f"{HANG_DIR}/verdict.json", restart=0)
    run1 = "srun: error: node2: task 1: Exited with exit code 3\n"
    events = [event("run_started", restart=1, nodes="node[1-2]", requeued_by="hpkit")]
    v = decide(facts(run1, [record("FAILED", restarts=1)], extra=[verdict], torchrun=False, events=events))
    assert (v.kind, v.rank) == (why.PROGRAM_ERROR, 1), v.summary
    # The same verdict in the run that wrote it is the verdict.
    v = decide(facts(run1, [record("FAILED", restarts=0)], extra=[verdict], torchrun=False))
    assert v.kind == why.HANG


def test_a_hang_with_no_restart_left_is_named_by_the_end_event():
    end = event(
        "end",
        outcome="hang_budget_spent",
        exit=1,
        verdict=f"{HANG_DIR}/verdict.json",
        budget_left=0,
        max_restarts=0,
    )
    v = decide(facts(HANG, [record("FAILED", exit_code="1:0")], torchrun=True, events=[end]))
    assert v.kind == why.HANG and v.rank == 1 and v.summary.endswith(f"; stacks in {HANG_DIR}")
    assert any(e.source == EVENTS for e in v.evidence)


NODE_LOST_EVENTS = [event("node_lost", nodes=["node2"], exit=1, then="ended")]


def test_a_lost_node_beats_the_survivors_connection_errors():
    v = decide(facts(NODE_LOST, [record("NODE_FAIL", exit_code="0:15")], events=NODE_LOST_EVENTS))
    assert v.kind == why.NODE_FAILURE and v.node == "node2" and v.summary == "node failure: node2"
    assert not any("Connection closed" in e.text for e in v.evidence)
    assert_cited(v, NODE_LOST)


def test_node_fail_from_slurmctld_alone_names_the_node():
    log = "[2026-11-25T11:28:41.205] Killing JobId=19823 on failed node node4\n"
    found = scan_slurm_log(log.splitlines(True), "/c/log/slurmctld.log", "19823")
    v = decide(Facts("19823", [record("NODE_FAIL")], found))
    assert v.kind == why.NODE_FAILURE and v.node == "node4"
    assert v.evidence[0] == why.Evidence("/c/log/slurmctld.log", 1, log.strip())


def test_a_lost_node_cites_each_source_once_so_the_controller_s_record_is_not_crowded_out():
    # srun printed its line twice in a CI run of test_why_jobs, and the three lines cited then held no slurmctld line.
    output = NODE_LOST.replace(
        "srun: error: node1: task 0",
        "srun: error: Node failure on node2\nsrun: error: Node failure on node2\nsrun: error: node1: task 0",
    )
    log = "[2026-11-25T12:00:40.100] Killing JobId=7002 on failed node node2\n"
    found = scan_slurm_log(log.splitlines(True), "/c/log/slurmctld.log", "7002")
    v = decide(facts(output, [record("NODE_FAIL", exit_code="0:15")], extra=found, events=NODE_LOST_EVENTS))
    assert (v.kind, v.node) == (why.NODE_FAILURE, "node2"), v.summary
    sources = [e.source for e in v.evidence]
    assert "/c/log/slurmctld.log" in sources and EVENTS in sources, v.evidence
    assert sum("Node failure on node2" in e.text for e in v.evidence) == 1, v.evidence


SLURMD_OOM = """\
[2026-11-25T11:24:55.808] [19810.0] debug:  StepId=19810.0 memory used:199548928 limit:104857600 B
[2026-11-25T11:24:55.808] [19810.0] error: StepId=19810.0 exceeded memory limit (199548928 > 104857600), being killed
[2026-11-25T11:24:55.810] [19810.batch] error: Exceeded job memory limit
[2026-11-25T11:24:55.820] [19810.0] error: StepId=19810.0 exceeded memory limit (199548928 > 104857600), being killed
"""


def test_out_of_memory_names_the_record_node_and_rank():
    repeated = OOM.replace(
        "srun: Job step", "slurmstepd-node1: error: Exceeded job memory limit\nsrun: Job step"
    )
    slurmd = scan_slurm_log(SLURMD_OOM.splitlines(True), "/c/log/slurmd-node1.log", "19810", "node1")
    assert [f.detail for f in slurmd] == [
        "StepId=19810.0 exceeded memory limit (199548928 > 104857600), being killed",
        "Exceeded job memory limit",
        "StepId=19810.0 exceeded memory limit (199548928 > 104857600), being killed",
    ]
    v = decide(facts(repeated, [record("FAILED", exit_code="137:0")], extra=slurmd, torchrun=False))
    # each record once per source, the job's output first, slurmd's log next, then the killed task
    assert [(e.source, e.line) for e in v.evidence[:5]] == [
        ("/w/logs/job.out", 2),
        ("/w/logs/job.out", 3),
        ("/c/log/slurmd-node1.log", 2),
        ("/c/log/slurmd-node1.log", 3),
        ("/w/logs/job.out", 6),
    ]
    assert_cited(v, repeated)
    v = decide(facts(OOM, [record("FAILED", exit_code="137:0")], torchrun=False))
    assert v.kind == why.OUT_OF_MEMORY and v.node == "node1" and v.rank == 0
    assert v.summary == (
        "out of memory on node1 (rank 0): StepId=19810.0 exceeded memory limit (199548928 > 104857600), being killed"
    )
    assert_cited(v, OOM)


def test_out_of_memory_summary_is_the_steps_record_when_the_batch_line_comes_first():
    # slurmstepd writes the batch step's line and the step's line in either order (CI saw the batch's first).
    batch_first = (
        "slurmstepd-node1: error: Exceeded job memory limit\n"
        "0: slurmstepd-node1: error: StepId=5804.0 exceeded memory limit (274030592 > 209715200), being killed\n"
        "srun: error: node1: task 0: Killed\n"
    )
    v = decide(facts(batch_first, [record("FAILED", exit_code="137:0")], torchrun=False))
    assert v.kind == why.OUT_OF_MEMORY and v.node == "node1" and v.rank == 0
    assert v.summary == (
        "out of memory on node1 (rank 0): StepId=5804.0 exceeded memory limit (274030592 > 209715200), being killed"
    )


@pytest.mark.parametrize(
    "line",
    [
        "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=19810.0. Some of your processes may have been killed by the cgroup out-of-memory handler.",
        "[12345.678] Out of memory: Killed process 4242 (python) total-vm:9000kB",
        "slurmstepd: error: Exceeded step memory limit at some point.",
    ],
)
def test_other_oom_records(line):
    text = f"{line}\nsrun: error: node1: task 0: Killed\n"
    assert decide(facts(text)).kind == why.OUT_OF_MEMORY


def test_out_of_memory_state_alone():
    v = decide(Facts("1", [record("OUT_OF_MEMORY")], []))
    assert v.kind == why.OUT_OF_MEMORY


def test_the_time_limit_beats_the_signal_the_ranks_die_of():
    v = decide(facts(TIME_LIMIT, [record("TIMEOUT", time_limit="1")]))
    assert v.kind == why.TIME_LIMIT
    assert v.summary == "time limit (1 min): Slurm ended the job at 2026-11-25T11:29:34"
    assert_cited(v, TIME_LIMIT)


def test_cancelled_by_whom_from_slurmctld_and_when_from_slurmstepd():
    found = scan_slurm_log(SLURMCTLD.splitlines(True), "/c/log/slurmctld.log", "19824")
    assert len(found) == 1  # JobId=198240 is another job
    v = decide(facts(CANCELLED, [record("CANCELLED")], extra=found), name_of={0: "root"}.get)
    assert v.kind == why.CANCELLED
    assert v.summary == "cancelled by root (uid 0) at 2026-11-25T11:28:16"
    assert_cited(v, CANCELLED)
    assert "STEP" not in v.evidence[0].text


def test_preempted_and_requeued():
    events = [event("usr1"), event("requeue", reason="usr1", to_restart=1, max_restarts=3, budget_left=2)]
    v = decide(facts(REQUEUED_USR1, [record("PENDING", restarts=1)], events=events))
    assert v.kind == why.PREEMPTED
    assert v.summary.startswith("preempted and requeued (restart 1 of 3)")
    assert_cited(v, events_text(events), EVENTS)


def test_preempted_by_slurm():
    text = (
        "slurmstepd-node1: error: *** JOB 9 ON node1 CANCELLED AT 2026-11-25T11:29:34 DUE TO PREEMPTION ***\n"
    )
    assert decide(facts(text, [record("PREEMPTED")])).kind == why.PREEMPTED


TWO_RUNS_EVENTS = [
    event("run_started", nodes="node[1-2]"),
    event("node_lost", nodes=["node2"], exit=1, then="requeued"),
    event("run_started", restart=1, nodes="node[1,3]", requeued_by="slurm", lost_nodes=["node2"]),
]


def test_only_the_last_run_of_a_requeued_job_counts():
    second = 6  # the second run's first line (its events record the log's size then)
    v = decide(facts(TWO_RUNS, [record("COMPLETED", restarts=1)], events=TWO_RUNS_EVENTS, start_line=second))
    assert v.kind == why.COMPLETED and v.summary == "completed after 1 restart(s)"
    # the same log, judged with the job still failing: the first run's KeyError is not this run's
    failed = TWO_RUNS.replace("0: hpkit train: done steps=20 final_loss=4.1 tokens_per_s=900 world=2\n", "")
    v = decide(facts(failed, [record("FAILED", restarts=1)], events=TWO_RUNS_EVENTS, start_line=second))
    assert "KeyError" not in v.summary


def test_an_injected_exit_is_a_program_error_with_its_code():
    text = (
        "hpkit: job 8 (restart 0 of at most 0) on node[1-2], rendezvous x:1\n"
        "2: hpkit: fault injected (HPKIT_FAULT): exit on rank 2 before step 5\n"
        "srun: error: node2: task 2: Exited with exit code 3\n"
        "srun: error: node1: tasks 0-1: Terminated\n"
    )
    v = decide(facts(text, torchrun=False))
    assert v.kind == why.PROGRAM_ERROR and v.rank == 2
    assert v.summary == "program error on rank 2: exit code 3, no traceback (an injected HPKIT_FAULT)"


def test_chained_exceptions_and_unlabelled_single_process_output():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/w/a.py", line 3, in <module>\n'
        "    d['x']\n"
        "KeyError: 'x'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/w/a.py", line 5, in <module>\n'
        "    raise RuntimeError('no x')\n"
        "RuntimeError: no x\n"
    )
    v = decide(facts(text))
    assert v.kind == why.PROGRAM_ERROR and v.rank is None
    assert v.summary == "program error: KeyError: 'x' (/w/a.py:3)"


def test_completed_and_not_ended_and_unknown():
    done = decide(facts("0: hpkit train: done steps=10\n", [record("COMPLETED", exit_code="0:0")]))
    assert done.kind == why.COMPLETED and done.summary == "completed"
    running = decide(Facts("1", [record("RUNNING", nodes="node[1-2]")], []))
    assert running.kind == why.NOT_ENDED and running.summary == "not ended: RUNNING on node[1-2]"
    unknown = decide(Facts("1", [], [], ["sacct: Slurm accounting storage is disabled"]))
    assert unknown.kind == why.UNKNOWN and "could not read 1 source" in unknown.summary
    assert unknown.lines()[-1] == "  could not read: sacct: Slurm accounting storage is disabled"
    failed = decide(Facts("1", [record("FAILED", exit_code="2:0")], []))
    assert failed.kind == why.PROGRAM_ERROR and "exited with 2" in failed.summary


def test_json_has_the_verdict_its_evidence_and_what_could_not_be_read():
    found = scan_output(NODE_LOST.splitlines(True), "/o")
    found += scan_events(events_text(NODE_LOST_EVENTS).splitlines(True), EVENTS).findings
    v = decide(Facts("7", [record("NODE_FAIL")], found, ["sacct: x"]))
    data = json.loads(json.dumps(v.to_json()))
    assert set(data) == {"job_id", "kind", "summary", "rank", "node", "state", "evidence", "unreadable"}
    assert data["kind"] == "node_failure" and data["node"] == "node2" and data["unreadable"] == ["sacct: x"]
    assert all(set(e) == {"source", "line", "text"} for e in data["evidence"])


def test_jobcomp_keeps_one_line_per_run_and_the_last_decides():
    log = (
        "JobId=71 UserId=root(0) GroupId=root(0) Name=a JobState=COMPLETED Partition=dev TimeLimit=5\n"
        "JobId=7 UserId=root(0) GroupId=root(0) Name=t JobState=NODE_FAIL Partition=dev TimeLimit=UNLIMITED\n"
        "JobId=7 UserId=root(0) GroupId=root(0) Name=t JobState=TIMEOUT Partition=dev TimeLimit=1 "
        "StartTime=2026-11-25T11:28:09 EndTime=2026-11-25T11:29:34 NodeList=node1 WorkDir=/w ExitCode=0:15\n"
    )
    records = scan_jobcomp(log.splitlines(True), "/c/log/jobcomp.txt", "7")
    assert [r.state for r in records] == ["NODE_FAIL", "TIMEOUT"]
    assert records[-1].restarts == 1 and records[-1].evidence[0].line == 3
    v = decide(Facts("7", [records[-1]], []))
    assert v.summary == "time limit (1 min): Slurm ended the job at 2026-11-25T11:29:34"


def test_scontrol_record_cites_its_own_lines():
    text = (
        "JobId=19824 JobName=cancelme\n"
        "   JobState=CANCELLED Reason=None Dependency=(null)\n"
        "   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15\n"
        "   Command=/w/logs/job with space.sbatch\n"
    )
    rec, fields = scan_scontrol(text, "scontrol show job 19824")
    assert rec.state == "CANCELLED" and rec.restarts == 0 and rec.exit_code == "0:15"
    assert fields["Command"] == "/w/logs/job with space.sbatch"
    assert [e.text for e in rec.evidence] == [
        "JobState=CANCELLED Reason=None Dependency=(null)",
        "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15",
    ]


def test_metrics_give_the_last_runs_end_or_its_last_step():
    lines = [
        '{"time": 1, "event": "start", "step": 0, "total_steps": 20}',
        '{"step": 1, "loss": 5.0}',
        '{"time": 2, "event": "end", "step": 1, "stopped_by_signal": 10}',
        '{"time": 3, "event": "start", "step": 1, "restart": 1}',
        '{"step": 2, "loss": 4.0}',
    ]
    found = scan_metrics([line + "\n" for line in lines], "/m.jsonl")
    assert [(f.kind, f.detail, f.evidence[0].line) for f in found] == [(why.LAST_STEP, "step 2", 5)]


def _fake_slurmless_job(tmp_path: Path) -> dict[str, str]:
    """A job that hpkit submit noted, on a machine without Slurm: only its files speak."""
    out = tmp_path / "logs"
    out.mkdir()
    script = out / "t.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --job-name=t\n#SBATCH --output={out}/%x-%j.out\nsrun python x.py\n"
    )
    (out / "t-4242.out").write_text(CANCELLED)
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True)
    note = {"job_id": "4242", "name": "t", "script": str(script), "workdir": str(tmp_path)}
    (state / "jobs" / "4242.json").write_text(json.dumps(note))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    return {
        **os.environ,
        "PATH": str(bindir),
        "HPKIT_STATE_DIR": str(state),
        "PYTHONPATH": str(REPO / "python"),
    }


def _hpkit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkit", "why", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_without_slurm_the_verdict_comes_from_the_noted_files(tmp_path):
    env = _fake_slurmless_job(tmp_path)
    done = _hpkit(env, "4242", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["kind"] == "cancelled" and data["state"] is None
    assert data["evidence"][0] == {
        "source": str(tmp_path / "logs" / "t-4242.out"),
        "line": 4,
        "text": "slurmstepd-node1: error: *** JOB 19824 ON node1 CANCELLED AT 2026-11-25T11:28:16 ***",
    }
    assert any(u.startswith("scontrol: not found") for u in data["unreadable"])
    text = _hpkit(env, "4242")
    assert text.returncode == 0 and text.stdout.startswith("cancelled at 2026-11-25T11:28:16")


@pytest.mark.parametrize(
    ("job", "message", "status"),
    [
        (
            "12ab",
            "hpkit why: error: argument job_id: '12ab' is not a Slurm job id (a number such as 1234)",
            2,
        ),
        ("5555", "hpkit why: error: job 5555 is unknown: slurmctld does not remember it", 1),
    ],
)
def test_bad_input_is_one_line_not_a_traceback(tmp_path, job, message, status):
    env = _fake_slurmless_job(tmp_path)
    done = _hpkit(env, job)
    assert done.returncode == status and done.stdout == ""
    # One line, and no traceback; a malformed id is a usage error, after argparse's usage line.
    lines = done.stderr.splitlines()
    assert lines[-1].startswith(message) and len(lines) == (2 if status == 2 else 1), done.stderr
