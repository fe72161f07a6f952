"""Why a job ended (`hpkit why JOB`): one verdict, and the lines it rests on.

hpkit.jobs.why_gather reads what a job left (its output, hpkit's files, Slurm's records and logs);
hpkit.jobs.why_scan turns their lines into findings; `decide` here is the rule. It is pure: a test hands it
findings made from log snippets.

The rule, first match wins:

1. Slurm says COMPLETED: completed, whatever happened before (a hang restarted, a requeue).
2. A hang: the supervisor's end event naming a hang verdict (the budget was spent), or the watchdog's
   verdict.json for the last run that no restart event names (hpkit.job_events). It beats the exit 75 every rank then reports, and
   torchrun's "first observed failure", which is just the rank that exited first.
3. A node failure (Slurm's NODE_FAIL, srun's "Node failure on", "DUE TO NODE FAILURE", the supervisor's
   lost-node events, slurmctld's "Killing JobId=N on failed node"): the survivors' "Connection closed by peer" and
   exits are its consequences.
4. Out of memory (an "exceeded memory limit" or oom-kill record, Slurm's OUT_OF_MEMORY): the SIGKILL that
   follows is the OOM killer's.
5. The time limit ("DUE TO TIME LIMIT", slurmctld's "Time limit exhausted", Slurm's TIMEOUT).
6. Preemption ("DUE TO PREEMPTION", PREEMPTED), or hpkit's own requeue after USR1 (its event, the runs file).
7. A cancel request ("CANCELLED AT" a job without a reason, slurmctld's REQUEST_KILL_JOB with the uid,
   sacct's "CANCELLED by uid").
8. The program: the launcher's first failure (torchrun's "Root Cause (first observed failure)" block, else
   srun's first failed task) names the rank; that rank's own traceback gives the exception and file:line,
   else its signal or exit code. Without a launcher record, the first traceback that is not a follow-on
   (a peer's closed connection, a timeout, a signal) wins, in file order.
9. Slurm's state alone (CANCELLED, FAILED with its exit code), else unknown, naming what could not be read.
"""

from __future__ import annotations

import pwd
import re
import signal as signals
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpkit.warm.protocol import STAYED_EXIT

# Verdict kinds.
COMPLETED = "completed"
PROGRAM_ERROR = "program_error"
SIGNAL = "signal"
OUT_OF_MEMORY = "out_of_memory"
NODE_FAILURE = "node_failure"
HANG = "hang"
TIME_LIMIT = "time_limit"
PREEMPTED = "preempted"
CANCELLED = "cancelled"
NOT_ENDED = "not_ended"
UNKNOWN = "unknown"

# What a finding says (hpkit.jobs.why_scan makes them).
# The supervisor's events (hpkit.job_events) make RUN_START, USR1, REQUEUE, REQUEUED_AFTER_NODE, HANG_END,
# HANG_RESTARTED, PROGRAM_FAILED and some NODE_LOST; the rest come from the output and Slurm's records.
RUN_START = "run_start"  # a run's start event
TRACEBACK = "traceback"  # a Python traceback's exception line; rank from the line's label
LAUNCHER_ROOT = "launcher_root"  # torchrun's "Root Cause (first observed failure)" block
TASK_FAILED = "task_failed"  # srun's "srun: error: NODE: task N: Exited with exit code C" / "task N: Killed"
RANK_FAILED_ON = "rank_failed_on"  # hpkit-torchrun's "rank R failed on NODE": a torchrun rank's node
RANK_STAYED = "rank_stayed"  # hpkit train's "rank R on NODE stays in process P for the next step: ..."
FAULT = "fault"  # "hpkit: fault injected (HPKIT_FAULT): exit on rank R before step N"
PROGRAM_FAILED = "program_failed"  # the supervisor ended the job: the step failed on healthy nodes
HANG_LINE = "hang_line"  # rank 0's "hpkit: hang: rank R on NODE held up step N ...; stacks ... in DIR"
HANG_END = "hang_end"  # the supervisor's end event: the step hung (verdict DIR) and no restart is left
HANG_RESTARTED = "hang_restarted"  # the supervisor's restart event after a hang (verdict DIR)
HANG_VERDICT = "hang_verdict"  # the watchdog's <output_dir>/hangs/<job>-<restart>-...-step<N>/verdict.json
NODE_LOST = "node_lost"
OOM_RECORD = "oom_record"
_STEP_OVER_LIMIT = re.compile(r"StepId=\S+ exceeded memory limit")
TIME_LIMIT_RECORD = "time_limit_record"
PREEMPT_RECORD = "preempt_record"
CANCEL_RECORD = "cancel_record"  # "*** JOB N ON node CANCELLED AT T ***" (no reason: someone cancelled it)
CANCEL_REQUEST = "cancel_request"  # who: slurmctld's REQUEST_KILL_JOB ... uid U, sacct's "CANCELLED by U"
USR1 = "usr1"  # the supervisor's event: USR1 reached the job
REQUEUE = "requeue"  # hpkit requeued the job (the supervisor's event, the runs file)
REQUEUED_AFTER_NODE = "requeued_after_node"  # a run's start event: Slurm requeued it, previous nodes down
TRAIN_DONE = "train_done"  # "hpkit train: done ..." or the metrics file's end record
TRAIN_STOPPED = "train_stopped"  # "hpkit train: stopping at step N on signal S"
LAST_STEP = "last_step"  # the metrics file's last step record

# Slurm's state of a run that a requeue ended (sacct's; the completion log of 24.11 writes PENDING: why_scan).
REQUEUED_STATE = "REQUEUED"
ENDED_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
MAX_EVIDENCE = 12


@dataclass(frozen=True)
class Evidence:
    """One line a verdict rests on: from a file (`line` is its 1-based number) or a command's output (`line` None)."""

    source: str
    line: int | None
    text: str

    def render(self, width: int = 300) -> str:
        text = self.text if len(self.text) <= width else self.text[: width - 1] + "…"
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"  {where}: {text}"

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "line": self.line, "text": self.text}


@dataclass(frozen=True)
class Finding:
    """What one line (or block) says. `evidence` are the lines themselves, the deciding one first."""

    kind: str
    evidence: tuple[Evidence, ...]
    rank: int | None = None
    node: str | None = None
    detail: str = ""  # an exception "Type: message", a hang line, a node list, a reason
    where: str = ""  # an exception's file:line; a hang's stacks folder
    signal: int | None = None
    exit_code: int | None = None
    follow_on: bool = False  # a consequence of another failure (a peer's closed connection, a signal)
    when: str = ""
    uid: int | None = None
    restart: int | None = None  # the run (Slurm's restart count) a hang verdict or a run header belongs to


@dataclass(frozen=True)
class SlurmRecord:
    """Slurm's word on the job: `scontrol show job`, a job-completion log line, or sacct."""

    source: str
    state: str
    exit_code: str = ""
    reason: str = ""
    restarts: int | None = None
    nodes: str = ""
    time_limit: str = ""
    end: str = ""
    name: str = ""
    workdir: str = ""
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class Facts:
    job_id: str
    records: Sequence[SlurmRecord]  # the most current first: the controller, the completion log, sacct
    findings: Sequence[Finding]  # in the order read: each source's lines in file order
    unreadable: Sequence[str] = ()
    torchrun: bool | None = None  # the job's step runs torchrun (srun's task ids are then nodes, not ranks)


@dataclass(frozen=True)
class Verdict:
    job_id: str
    kind: str
    summary: str  # the first line printed
    rank: int | None = None
    node: str | None = None
    state: str | None = None  # Slurm's, where it said
    evidence: list[Evidence] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [self.summary, *(e.render() for e in self.evidence)]
        out += [f"  could not read: {what}" for what in self.unreadable]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "kind": self.kind,
            "summary": self.summary,
            "rank": self.rank,
            "node": self.node,
            "state": self.state,
            "evidence": [e.to_json() for e in self.evidence],
            "unreadable": list(self.unreadable),
        }


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def decide(facts: Facts, name_of: Callable[[int], str] = user_name) -> Verdict:
    """The verdict for `facts` (module docstring: the rule and its order)."""
    record = facts.records[0] if facts.records else None
    state = record.state if record else None
    found = _Found(facts.findings)
    verdict = _decide(facts, record, found, name_of)
    evidence = list(verdict.evidence)
    if record is not None:
        evidence += record.evidence
    return Verdict(
        job_id=facts.job_id,
        kind=verdict.kind,
        summary=verdict.summary,
        rank=verdict.rank,
        node=verdict.node,
        state=state,
        evidence=_dedup(evidence)[:MAX_EVIDENCE],
        unreadable=list(facts.unreadable),
    )


@dataclass(frozen=True)
class _Call:
    kind: str
    summary: str
    evidence: Sequence[Evidence] = ()
    rank: int | None = None
    node: str | None = None


class _Found:
    def __init__(self, findings: Sequence[Finding]):
        self.all = list(findings)

    def of(self, *kinds: str) -> list[Finding]:
        return [f for f in self.all if f.kind in kinds]

    def first(self, *kinds: str) -> Finding | None:
        return next((f for f in self.all if f.kind in kinds), None)


def _ev(*findings: Finding | None) -> list[Evidence]:
    return [e for f in findings if f is not None for e in f.evidence]


def _dedup(evidence: list[Evidence]) -> list[Evidence]:
    seen: set[tuple[str, int | None, str]] = set()
    out = []
    for e in evidence:
        key = (e.source, e.line, e.text)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _decide(facts: Facts, record: SlurmRecord | None, found: _Found, name_of: Callable[[int], str]) -> _Call:
    state = record.state if record else None
    if state == "COMPLETED":
        return _completed(record, found)
    if state is not None and state not in ENDED_STATES:
        requeued = found.first(REQUEUE, PREEMPT_RECORD, NODE_LOST, REQUEUED_AFTER_NODE)
        if requeued is None and state == REQUEUED_STATE:
            # Nothing read says why (an admin's `scontrol requeue`, say): the record alone, not a pending run.
            return _Call(
                NOT_ENDED,
                "requeued: Slurm requeued the job's last run (`scontrol requeue`, or a requeue on failure); "
                "no later run has ended",
            )
        if requeued is None or state == "RUNNING":
            where = f" on {record.nodes}" if record and record.nodes and state == "RUNNING" else ""
            return _Call(NOT_ENDED, f"not ended: {state}{where}")
    for rule in (_hang, _node_failure, _out_of_memory, _time_limit, _preempted):
        call = rule(found, record, facts.torchrun)
        if call is not None:
            return call
    call = _cancelled(found, record, name_of, requested_only=True)
    if call is not None:
        return call
    call = _program(found, facts.torchrun)
    if call is not None:
        return call
    call = _cancelled(found, record, name_of, requested_only=False)
    if call is not None:
        return call
    if state == "FAILED" and record is not None:
        code = record.exit_code.split(":")[0] if record.exit_code else "?"
        return _Call(
            PROGRAM_ERROR,
            f"program error: the job script exited with {code}; its output names no rank, traceback or signal",
        )
    said = f"Slurm says {state}" + (f" (ExitCode={record.exit_code})" if record and record.exit_code else "")
    if state is None:
        said = "no Slurm record of its end"
    missing = f"; could not read {len(facts.unreadable)} source(s), listed below" if facts.unreadable else ""
    return _Call(UNKNOWN, f"unknown: {said}, and nothing read tells why{missing}")


def _completed(record: SlurmRecord | None, found: _Found) -> _Call:
    restarts = record.restarts if record else None
    after = f" after {restarts} restart(s)" if restarts else ""
    stopped = found.first(TRAIN_STOPPED)
    done = found.first(TRAIN_DONE)
    if stopped is not None and done is None:
        return _Call(
            COMPLETED,
            f"completed{after}, but training stopped early: {stopped.detail}",
            _ev(stopped, found.first(USR1)),
        )
    # The step hung and the supervisor restarted it in the allocation (on a spare where it had one): the job
    # completed, and the hang is named all the same, since the node it names is worth a look.
    restarted = {_folder(f.where) for f in found.of(HANG_RESTARTED)}
    hung = [v for v in found.of(HANG_VERDICT) if _folder(v.where) in restarted]
    if hung:
        last = hung[-1]
        text = last.detail.removeprefix("hpkit: ")
        times = f"{len(hung)} times, the last: " if len(hung) > 1 else ""
        summary = f"completed{after}; the step hung and was restarted in the allocation ({times}{text})"
        return _Call(COMPLETED, summary, _ev(done, *hung), last.rank, last.node)
    return _Call(COMPLETED, f"completed{after}", _ev(done))


def _hang(found: _Found, record: SlurmRecord | None, _torchrun: bool | None) -> _Call | None:
    # A hang's folder (<job>-<restart>-<attempt>-<n>-step<N>) ties the watchdog's line, its verdict.json and
    # the supervisor's events together; a line may name it relative where the ranks wrote it absolute.
    end = found.first(HANG_END)
    restarted = {_folder(f.where) for f in found.of(HANG_RESTARTED)}
    verdicts = [v for v in found.of(HANG_VERDICT) if _folder(v.where) not in restarted]
    if record is not None and record.restarts is not None:
        verdicts = [v for v in verdicts if v.restart in (None, record.restarts)]
    lines = [h for h in found.of(HANG_LINE) if _folder(h.where) not in restarted]
    if end is not None:
        verdicts = [v for v in verdicts if _folder(v.where) == _folder(end.where)]
        lines = [h for h in lines if _folder(h.where) == _folder(end.where)]
    elif not verdicts and not lines:
        return None
    main = verdicts[-1] if verdicts else None
    line = lines[-1] if lines else None
    source = main or line
    text = source.detail.removeprefix("hpkit: ") if source else "hang: the step hung"
    stacks = next((f.where for f in (main, line, end) if f is not None and f.where), "")
    summary = text + (f"; stacks in {stacks}" if stacks else "")
    rank = source.rank if source else None
    node = source.node if source else None
    return _Call(HANG, summary, _ev(line, main, end), rank, node)


def _folder(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _node_failure(found: _Found, record: SlurmRecord | None, _torchrun: bool | None) -> _Call | None:
    lost = found.of(NODE_LOST)
    if not lost and not (record and record.state == "NODE_FAIL"):
        return None
    named = [f for f in lost if f.node]
    nodes = ",".join(dict.fromkeys(f.node for f in named if f.node)) or None
    requeue = found.first(REQUEUED_AFTER_NODE)
    then = ""
    if record is not None and record.state not in ENDED_STATES:
        then = f"; Slurm requeued the job ({record.state})"
    summary = (
        f"node failure: {nodes}" if nodes else "node failure (Slurm says NODE_FAIL; the node is not named)"
    )
    # Each source's first line: srun may print its "Node failure on" twice, and repeats from the job's output
    # crowded the controller's own record ("Killing JobId=N on failed node") out of the lines cited.
    per_source: dict[str, Finding] = {}
    for f in named:
        per_source.setdefault(f.evidence[0].source, f)
    return _Call(
        NODE_FAILURE,
        summary + then,
        _ev(*list(per_source.values())[:4], *[f for f in lost if not f.node][:2], requeue),
        None,
        nodes,
    )


def _out_of_memory(found: _Found, record: SlurmRecord | None, torchrun: bool | None) -> _Call | None:
    oom = found.of(OOM_RECORD)
    if not oom and not (record and record.state == "OUT_OF_MEMORY"):
        return None
    # The step's own record names the step and its usage against the limit; the batch step's "Exceeded job memory
    # limit" only follows from it, and the two reach the output in either order.
    first = next((f for f in oom if _STEP_OVER_LIMIT.search(f.detail)), oom[0]) if oom else None
    node = next((f.node for f in oom if f.node), None)
    killed = [
        t for t in found.of(TASK_FAILED) if t.signal == signals.SIGKILL and (node is None or t.node == node)
    ]
    task = killed[0] if killed else None
    # srun's task ids are ranks when srun starts every rank; under torchrun they count nodes.
    rank = task.rank if task is not None and not torchrun else None
    record_text = first.detail if first else "Slurm says OUT_OF_MEMORY"
    where = " on " + node if node else ""
    who = f" (rank {rank})" if rank is not None else ""
    # The same record comes from the job's output and slurmd's log, often twice: one line per source and text.
    shown = list({(f.evidence[0].source, f.detail): f for f in oom[::-1]}.values())  # each pair's first
    shown.sort(key=oom.index)
    return _Call(
        OUT_OF_MEMORY, f"out of memory{where}{who}: {record_text}", _ev(*shown[:4], task), rank, node
    )


def _time_limit(found: _Found, record: SlurmRecord | None, _torchrun: bool | None) -> _Call | None:
    hits = found.of(TIME_LIMIT_RECORD)
    if not hits and not (record and record.state == "TIMEOUT"):
        return None
    when = next((f.when for f in hits if f.when), "") or (record.end if record else "")
    limit = record.time_limit if record and record.time_limit else ""
    summary = "time limit" + (f" ({limit} min)" if limit.isdigit() else f" ({limit})" if limit else "")
    summary += f": Slurm ended the job at {when}" if when else ""
    return _Call(TIME_LIMIT, summary, _ev(*hits[:3], found.first(USR1)))


def _preempted(found: _Found, record: SlurmRecord | None, _torchrun: bool | None) -> _Call | None:
    preempt = found.of(PREEMPT_RECORD)
    requeue = found.of(REQUEUE)
    state = record.state if record else None
    if not preempt and not requeue and state != "PREEMPTED":
        return None
    usr1 = found.first(USR1)
    if requeue:
        restart = next((f.detail for f in requeue if f.detail), "")
        summary = "preempted and requeued" + (f" ({restart})" if restart else "")
        if usr1 is not None and not preempt:
            summary += ": USR1 came (time limit or preemption) and hpkit requeued the job"
        return _Call(PREEMPTED, summary, _ev(usr1, *requeue[:2], *preempt[:2]))
    requeued = state is not None and state not in ENDED_STATES
    return _Call(PREEMPTED, "preempted and requeued" if requeued else "preempted", _ev(*preempt[:3], usr1))


def _cancelled(
    found: _Found, record: SlurmRecord | None, name_of: Callable[[int], str], requested_only: bool
) -> _Call | None:
    cancel = found.of(CANCEL_RECORD)
    request = found.of(CANCEL_REQUEST)
    if requested_only and not cancel and not request:
        return None
    if not requested_only and not (record and record.state == "CANCELLED"):
        return None
    uid = next((f.uid for f in request if f.uid is not None), None)
    when = next((f.when for f in cancel if f.when), "") or (record.end if record else "")
    summary = "cancelled"
    summary += f" by {name_of(uid)} (uid {uid})" if uid is not None else ""
    summary += f" at {when}" if when else ""
    if uid is None:
        summary += " (Slurm's records here do not say by whom)"
    return _Call(CANCELLED, summary, _ev(*cancel[:2], *request[:2]))


def _program(found: _Found, torchrun: bool | None) -> _Call | None:
    roots = found.of(LAUNCHER_ROOT)
    tasks = found.of(TASK_FAILED)
    tracebacks = found.of(TRACEBACK)
    causes = [t for t in tracebacks if not t.follow_on]
    faults = [f for f in found.of(FAULT) if f.detail == "exit"]
    via_torchrun = bool(roots) if torchrun is None else torchrun
    # A rank that stayed in its process for the next step (resilience.keep_survivors) left because another failed:
    # its launcher's exit (STAYED_EXIT) is never the first failure.
    stayed = {f.rank for f in found.of(RANK_STAYED)}
    if not via_torchrun:  # srun started every rank: its task id is the rank
        tasks = [t for t in tasks if t.rank not in stayed and t.exit_code != STAYED_EXIT]
    root = _first_root(roots, tracebacks, stayed)
    first_task = tasks[0] if tasks else None
    if root is None and first_task is not None and not via_torchrun:
        root = first_task  # srun started every rank: its task id is the rank
    if (
        root is not None
        and root.signal
        and first_task is not None
        and not _says_signal(first_task, root.signal)
    ):
        # srun reports the nodes' task exits in no set order: with torchrun, the node whose agent passes the
        # signal on (hpkit-torchrun exits 128 + it) is the rank's; its peers' agents exit 1 and may come first.
        first_task = next((t for t in tasks if _says_signal(t, root.signal)), first_task)
    placed = None
    if via_torchrun and root is not None and root.rank is not None:
        # The agent's own word for where the rank ran: srun's lines may not name that node at all, when srun killed
        # its agent (--kill-on-bad-exit) after a peer's agent exited first.
        placed = next((f for f in found.of(RANK_FAILED_ON) if f.rank == root.rank), None)
        if placed is not None:
            first_task = next((t for t in tasks if t.node == placed.node), None)
        elif root.node and not (
            root.signal and first_task is not None and _says_signal(first_task, root.signal)
        ):
            # Without it (plain torchrun), torchrun's block names its host: on a cluster, the node's hostname, which
            # srun's lines name too (not on the local cluster, whose nodes share one host).
            first_task = next((t for t in tasks if t.node == root.node), first_task)
    node = placed.node if placed is not None else first_task.node if first_task is not None else None
    launcher = _ev(root, placed, first_task if first_task is not root else None)
    if root is not None and root.rank is not None:
        own = [t for t in causes if t.rank == root.rank]
        if own:
            return _exception(own[0], launcher, node)
        if root.signal:
            return _killed(root, launcher, node)
    if causes:
        return _exception(causes[0], launcher, node)
    if root is not None and root.signal:
        return _killed(root, launcher, node)
    fault = next((f for f in faults if root is None or f.rank == root.rank), None)
    if root is not None and root.rank is not None and root.exit_code:
        return _Call(
            PROGRAM_ERROR,
            f"program error on rank {root.rank}: exit code {root.exit_code}, no traceback"
            + (" (an injected HPKIT_FAULT)" if fault else ""),
            _ev(fault, root, first_task if first_task is not root else None),
            root.rank,
            node,
        )
    if fault is not None:
        return _Call(
            PROGRAM_ERROR,
            f"program error on rank {fault.rank}: an injected HPKIT_FAULT exit",
            _ev(fault, first_task),
            fault.rank,
            node,
        )
    if tracebacks:
        call = _exception(tracebacks[0], launcher, node)
        return _Call(
            call.kind,
            call.summary + " (a follow-on error: the first failure was not recorded)",
            call.evidence,
            call.rank,
            call.node,
        )
    failed = found.first(PROGRAM_FAILED)
    if failed is not None:
        return _Call(
            PROGRAM_ERROR,
            f"program error: the step failed on healthy nodes ({failed.detail}); its output names no rank",
            _ev(failed, first_task),
            None,
            node,
        )
    return None


def _first_root(
    roots: Sequence[Finding], tracebacks: Sequence[Finding], stayed: set[int | None]
) -> Finding | None:
    """The job's first failure among torchrun's blocks: each node's agent prints one, naming its own node's first
    failure, and srun interleaves the nodes' output in no set order. A block whose rank's own traceback is a
    consequence (a peer's reset connection), or whose rank stayed in its process (`stayed`, its exit
    STAYED_EXIT), goes after the others, whatever the file order: its rank left for another's failure. Then the
    earliest `time` (to the second), then the file order."""

    # One pass over the tracebacks (a 16k-rank job has one block per node and a traceback per rank): the ranks with a
    # traceback, and those with one that is not a consequence.
    traced = {t.rank for t in tracebacks if t.rank is not None}
    caused = {t.rank for t in tracebacks if t.rank is not None and not t.follow_on}

    def consequence(root: Finding) -> bool:
        if root.exit_code == STAYED_EXIT or root.rank in stayed:
            return True
        return root.rank in traced and root.rank not in caused

    return min(roots, key=lambda r: (consequence(r), r.when), default=None)


def _exception(tb: Finding, launcher: list[Evidence], node: str | None) -> _Call:
    who = f" on rank {tb.rank}" if tb.rank is not None else ""
    where = f" ({tb.where})" if tb.where else ""
    return _Call(
        PROGRAM_ERROR, f"program error{who}: {tb.detail}{where}", [*tb.evidence, *launcher], tb.rank, node
    )


def _says_signal(task: Finding, signal: int) -> bool:
    """srun's line for the task says it ended by `signal` ("Killed", or "Exited with exit code 128+N")."""
    return task.signal == signal or task.exit_code == 128 + signal


def _killed(root: Finding, launcher: list[Evidence], node: str | None) -> _Call:
    assert root.signal is not None
    who = f" on rank {root.rank}" if root.rank is not None else ""
    on = f" ({node})" if node else ""
    summary = f"killed by signal {root.signal} ({signal_name(root.signal)}){who}{on}"
    return _Call(SIGNAL, summary, launcher, root.rank, node)
