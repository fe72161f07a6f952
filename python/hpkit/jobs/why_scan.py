"""Lines to findings for `hpkit why` (hpkit.jobs.why has the rule): one function per kind of source, each pure.

The lines they know:
- the job's events file (hpkit.job_events, written by the job's supervisor, hpkit.supervise): each run's
  start, USR1, restarts in the allocation, requeues, lost nodes, the end and its outcome. Only these, never
  the supervisor's human-readable lines, carry what the supervisor decided;
- the job's output: the ranks' output labelled `R: ` (srun --label, hpkit.line_label) and `[rankR]: ` (torch),
  the hang watchdog's and the fault injector's lines, Python tracebacks, torchrun's ChildFailedError block and
  hpkit-torchrun's line naming each failed rank's node,
  srun's per-task lines, slurmstepd's `*** JOB|STEP ... CANCELLED AT ... ***`, and memory-limit records;
- slurmctld's and slurmd's logs (the lines naming the job), the job-completion log (jobcomp/filetxt),
  `scontrol show job`, sacct, the hang watchdog's verdict.json, the runs file and the metrics file.

A requeued job appends each run to one output file, and a step restarted in the allocation appends there
too: only the last step's lines count (the events say where in the file it started), since an earlier
run's or attempt's end is not the job's.
"""

from __future__ import annotations

import json
import pwd
import re
import signal as signals
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from hpkit import job_events, json_text
from hpkit.jobs.why import (
    CANCEL_RECORD,
    CANCEL_REQUEST,
    FAULT,
    HANG_END,
    HANG_LINE,
    HANG_RESTARTED,
    HANG_VERDICT,
    LAST_STEP,
    LAUNCHER_ROOT,
    NODE_LOST,
    OOM_RECORD,
    PREEMPT_RECORD,
    PROGRAM_FAILED,
    RANK_FAILED_ON,
    RANK_STAYED,
    REQUEUE,
    REQUEUED_AFTER_NODE,
    REQUEUED_STATE,
    RUN_START,
    TASK_FAILED,
    TIME_LIMIT_RECORD,
    TRACEBACK,
    TRAIN_DONE,
    TRAIN_STOPPED,
    USR1,
    Evidence,
    Finding,
    SlurmRecord,
)
from hpkit.metrics.records import EndEvent, StartEvent, StepRecord, parse_record
from hpkit.slurm import AccountedRun, JobAccounting, parse_scontrol_record

# `R: ` as srun --label and hpkit.line_label write it (right-aligned), then torch's own `[rankR]: `.
_SRUN_LABEL = re.compile(r"^\s*(\d+): ")
_TORCH_LABEL = re.compile(r"^\[rank(\d+)\]:\s?")
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+), in (.+)$')
# An exception line: a class name (CamelCase, maybe dotted: torch.distributed.DistBackendError), then its message.
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?::\s?(.*))?$")
# Errors a rank raises because another rank or the launcher failed first, not by itself.
_FOLLOW_ON = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|DistBackendError|"
    r"SignalException|ChildFailedError|KeyboardInterrupt|Rendezvous\w*Error|timed out|Timeout|"
    r"NCCL communicator was aborted|Socket Timeout|ECONNRESET|EPIPE|ProcessGroup\w* is aborted",
    re.IGNORECASE,
)
_SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_SRUN_NODE_FAIL = re.compile(r"^srun: error: Node failure on (\S+)")
_STEPD = re.compile(
    r"\*\*\* (JOB|STEP) (\S+) ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([A-Z][A-Z ]*?[A-Z]))?(?:,| \*\*\*)"
)
_OOM = re.compile(
    r"exceeded (?:job |step )?memory limit|oom-kill|oom_kill|Out of memory: Kill|Memory cgroup out of memory|"
    r"OUT_OF_MEMORY|\bOOM failure",
    re.IGNORECASE,
)
_STEPD_NODE = re.compile(r"slurmstepd-([^:\s]+):")
_ROOT_FIELD = re.compile(r"^\s*(\w+)\s*: (.*)$")
# srun names a task's signal with strsignal(): "Killed", "Terminated", "Segmentation fault (core dumped)".
_SIGNAL_BY_TEXT = {
    text: int(sig)
    for sig in signals.Signals
    if (text := signals.strsignal(sig)) and not text.startswith("Unknown")
}


def _label(line: str) -> tuple[int | None, str, str]:
    """(rank, label key, content): the rank a line is labelled with, torch's label over srun's."""
    rank = None
    key = ""
    match = _SRUN_LABEL.match(line)
    if match:
        rank, key, line = int(match.group(1)), match.group(1), line[match.end() :]
    match = _TORCH_LABEL.match(line)
    if match:
        rank, key, line = int(match.group(1)), f"{key}/{match.group(1)}", line[match.end() :]
    return rank, key, line


@dataclass
class _OpenTraceback:
    rank: int | None
    frame: Evidence | None = None
    where: str = ""
    skipped: int = 0


@dataclass
class _OpenRoot:
    fields: dict[str, tuple[str, Evidence]] = field(default_factory=dict)


def scan_output(lines: Iterable[str], source: str, start_line: int = 1) -> list[Finding]:
    """The findings of a job's output file (stdout or stderr), from `start_line` on (where the last step
    started, as the job's events say; the whole file for a job without them)."""
    found: list[Finding] = []
    open_tracebacks: dict[str, _OpenTraceback] = {}
    root: _OpenRoot | None = None
    for number, raw in enumerate(lines, 1):
        if number < start_line:
            continue
        line = raw.rstrip("\r\n")
        ev = Evidence(source, number, line)
        rank, key, content = _label(line)
        if root is not None:
            if content.startswith("=") and root.fields:
                found.append(_root_finding(root))
                root = None
            else:
                field_match = _ROOT_FIELD.match(content)
                if field_match:
                    root.fields.setdefault(field_match.group(1), (field_match.group(2).strip(), ev))
                continue
        if content.strip() == "Root Cause (first observed failure):":
            root = _OpenRoot()
            continue
        if content == "Traceback (most recent call last):":
            open_tracebacks[key] = _OpenTraceback(rank)
            continue
        if key in open_tracebacks and _traceback_line(open_tracebacks, key, content, ev, found):
            continue
        found.extend(_line_findings(rank, content, ev))
    return found


def _traceback_line(
    open_tracebacks: dict[str, _OpenTraceback], key: str, content: str, ev: Evidence, found: list[Finding]
) -> bool:
    """Feed one line to an open traceback; True when the line belonged to it."""
    tb = open_tracebacks[key]
    frame = _FRAME.match(content)
    if frame:
        tb.frame, tb.where = ev, f"{frame.group(1)}:{frame.group(2)}"
        return True
    if not content.strip() or content[0] in " \t":
        return True
    exception = _EXCEPTION.match(content)
    if exception is None:
        tb.skipped += 1
        if tb.skipped > 50:
            del open_tracebacks[key]
        return False
    del open_tracebacks[key]
    detail = content.strip()
    evidence = (ev, tb.frame) if tb.frame is not None else (ev,)
    found.append(
        Finding(
            TRACEBACK,
            evidence,
            rank=tb.rank,
            detail=detail,
            where=tb.where,
            follow_on=bool(_FOLLOW_ON.search(detail)),
        )
    )
    return True


def _root_finding(root: _OpenRoot) -> Finding:
    fields = root.fields
    rank = _leading_int(fields.get("rank", ("", None))[0])
    exit_code = _leading_int(fields.get("exitcode", ("", None))[0])
    sig = -exit_code if exit_code is not None and exit_code < 0 else None
    evidence = [fields[k][1] for k in ("rank", "exitcode") if k in fields]
    if sig is not None and "traceback" in fields:
        evidence.append(fields["traceback"][1])
    return Finding(
        LAUNCHER_ROOT,
        tuple(evidence),
        rank=rank,
        node=fields.get("host", ("", None))[0] or None,
        signal=sig,
        exit_code=exit_code if sig is None else None,
        when=fields.get("time", ("", None))[0],
    )


def _leading_int(text: str) -> int | None:
    match = re.match(r"\s*(-?\d+)", text)
    return int(match.group(1)) if match else None


def _line_findings(rank: int | None, content: str, ev: Evidence) -> list[Finding]:
    """Everything but tracebacks and torchrun's block: srun, slurmstepd, memory, hpkit's own lines."""
    task = _SRUN_TASK.match(content)
    if task:
        outcome = task.group(3).strip()
        first = int(re.split(r"[,\-]", task.group(2))[0])
        code = re.match(r"Exited with exit code (\d+)", outcome)
        sig = _SIGNAL_BY_TEXT.get(outcome.removesuffix(" (core dumped)"))
        return [
            Finding(
                TASK_FAILED,
                (ev,),
                rank=first,
                node=task.group(1),
                signal=sig,
                exit_code=int(code.group(1)) if code else None,
                follow_on=sig == signals.SIGTERM,
            )
        ]
    node_fail = _SRUN_NODE_FAIL.match(content)
    if node_fail:
        return [Finding(NODE_LOST, (ev,), node=node_fail.group(1))]
    out = _stepd_findings(content, ev)
    if _OOM.search(content):
        node = _STEPD_NODE.search(content)
        out.append(
            Finding(OOM_RECORD, (ev,), node=node.group(1) if node else None, detail=_oom_text(content))
        )
    if content.startswith("hpkit"):
        out += _hpkit_findings(content, ev)
    return out


def _oom_text(content: str) -> str:
    match = _STEPD_NODE.search(content)
    text = content[match.end() :] if match else content
    return text.strip().removeprefix("error:").strip()


def _stepd_findings(content: str, ev: Evidence) -> list[Finding]:
    match = _STEPD.search(content)
    if match is None:
        return []
    what, _, node, when, reason = match.groups()
    if reason == "TIME LIMIT":
        return [Finding(TIME_LIMIT_RECORD, (ev,), node=node, when=when)]
    if reason == "PREEMPTION":
        return [Finding(PREEMPT_RECORD, (ev,), when=when)]
    if reason == "NODE FAILURE":
        return [Finding(NODE_LOST, (ev,), when=when)]  # `ON node` is where it was printed, not the lost node
    if reason is None and what == "JOB":
        return [Finding(CANCEL_RECORD, (ev,), node=node, when=when)]
    return []  # a step cancelled by srun --kill-on-bad-exit or by the job's own end: a consequence


def _hpkit_findings(content: str, ev: Evidence) -> list[Finding]:
    if hang := job_events.parse_hang_line(content):
        return [
            Finding(HANG_LINE, (ev,), rank=hang.rank, node=hang.node, detail=hang.text, where=hang.stacks)
        ]
    if placed := job_events.parse_rank_failed_line(content):
        return [Finding(RANK_FAILED_ON, (ev,), rank=placed.rank, node=placed.node)]
    if stays := job_events.parse_stays_line(content):
        return [Finding(RANK_STAYED, (ev,), rank=stays.rank, node=stays.node, follow_on=True)]
    if fault := job_events.parse_fault_line(content):
        kind, rank, _ = fault
        return [Finding(FAULT, (ev,), rank=rank, detail=kind)]
    if stopped := job_events.parse_stopping_line(content):
        words, _, sig = stopped
        return [Finding(TRAIN_STOPPED, (ev,), detail=words, signal=sig)]
    if job_events.parse_done_line(content) is not None:
        return [Finding(TRAIN_DONE, (ev,))]
    return []


def _mentions(line: str, job_id: str) -> bool:
    return bool(re.search(rf"(?:JobId=|StepId=|\[|job ){re.escape(job_id)}(?![\d])", line))


def scan_slurm_log(lines: Iterable[str], source: str, job_id: str, node: str | None = None) -> list[Finding]:
    """slurmctld's log, or slurmd's of `node`: the lines that name the job."""
    found: list[Finding] = []
    for number, raw in enumerate(lines, 1):
        if job_id not in raw or not _mentions(raw, job_id):
            continue
        line = raw.rstrip("\r\n")
        ev = Evidence(source, number, line)
        if match := re.search(r"REQUEST_KILL_JOB JobId=\d+ uid (\d+)", line):
            found.append(Finding(CANCEL_REQUEST, (ev,), uid=int(match.group(1)), when=_log_time(line)))
        elif "Time limit exhausted for JobId=" in line:
            found.append(Finding(TIME_LIMIT_RECORD, (ev,), when=_log_time(line)))
        elif match := re.search(r"Killing JobId=\d+ on failed node (\S+)", line):
            found.append(Finding(NODE_LOST, (ev,), node=match.group(1)))
        elif re.search(r"preempt", line, re.IGNORECASE):
            found.append(Finding(PREEMPT_RECORD, (ev,)))
        elif _OOM.search(line):
            found.append(Finding(OOM_RECORD, (ev,), node=node, detail=_oom_text(_LOG_PREFIX.sub("", line))))
    return found


_LOG_PREFIX = re.compile(r"^(?:\[[^\]]*\]\s*)+")


def _log_time(line: str) -> str:
    match = re.match(r"\[([^\]]+)\]", line)
    return match.group(1) if match else ""


def scan_jobcomp(lines: Iterable[str], source: str, job_id: str) -> list[SlurmRecord]:
    """The job-completion log (jobcomp/filetxt): one line per run of the job, oldest first."""
    prefix = f"JobId={job_id} "
    records = []
    for number, raw in enumerate(lines, 1):
        if raw.startswith(prefix):
            line = raw.rstrip("\r\n")
            fields = parse_scontrol_record(line)
            state = fields.get("JobState", "").split()[0] if fields.get("JobState") else ""
            if state == "PENDING":
                # A line is written when a run ends; for a run ended by a requeue (`scontrol requeue`) Slurm
                # 24.11 writes the job's new state, PENDING. The run itself was requeued (sacct's REQUEUED).
                state = REQUEUED_STATE
            records.append(
                SlurmRecord(
                    source=source,
                    state=state,
                    exit_code=fields.get("ExitCode", ""),
                    time_limit=fields.get("TimeLimit", ""),
                    end=fields.get("EndTime", ""),
                    nodes=fields.get("NodeList", ""),
                    name=fields.get("Name", ""),
                    workdir=fields.get("WorkDir", ""),
                    evidence=(Evidence(source, number, line),),
                )
            )
    if len(records) > 1:  # each earlier line is a run that was requeued
        records[-1] = replace(records[-1], restarts=len(records) - 1)
    return records


def scan_scontrol(text: str, source: str) -> tuple[SlurmRecord, dict[str, str]]:
    """`scontrol show job N` (several lines of Key=Value): the record, and every field."""
    fields: dict[str, str] = {}
    where: dict[str, Evidence] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        parsed = parse_scontrol_record(line)
        for key in parsed:
            where.setdefault(key, Evidence(source, None, line))
        fields.update(parsed)
    restarts = fields.get("Restarts", "")
    evidence = tuple(dict.fromkeys(where[k] for k in ("JobState", "ExitCode") if k in where))
    record = SlurmRecord(
        source=source,
        state=fields.get("JobState", ""),
        exit_code=fields.get("ExitCode", ""),
        reason=fields.get("Reason", ""),
        restarts=int(restarts) if restarts.isdigit() else None,
        nodes=fields.get("NodeList", ""),
        time_limit=fields.get("TimeLimit", ""),
        end=fields.get("EndTime", ""),
        name=fields.get("JobName", ""),
        workdir=fields.get("WorkDir", ""),
        evidence=evidence,
    )
    return record, fields


def scan_accounting(job: JobAccounting, source: str) -> tuple[SlurmRecord, list[Finding]]:
    """Accounting's record (hpkit.slurm.accounting): the last run as the record, its restarts the earlier runs
    (each cited with its state and nodes), and its steps' words (an OUT_OF_MEMORY step, who cancelled)."""
    lines = [_run_line(run, i, len(job.runs)) for i, run in enumerate(job.runs, 1)]
    evidence = tuple(Evidence(source, None, line) for line in reversed(lines))  # the last run first
    last = job.last
    found: list[Finding] = []
    if last.cancelled_by:
        uid = _uid(last.cancelled_by)
        found.append(Finding(CANCEL_REQUEST, evidence[:1], uid=uid, when=_when(last.end_time)))
    for step in last.steps:
        if step.state.value == "OUT_OF_MEMORY":
            detail = f"step {job.job_id}.{step.step}: OUT_OF_MEMORY"
            found.append(Finding(OOM_RECORD, evidence[:1], node=step.nodes or None, detail=detail))
    record = SlurmRecord(
        source=source,
        state=last.state.value,
        exit_code=_exit_text(last.exit_code, last.signal),
        reason=last.reason,
        restarts=job.requeues,
        nodes=last.nodes,
        end=_when(last.end_time),
        name=last.name,
        workdir=last.workdir,
        evidence=evidence,
    )
    return record, found


def _run_line(run: AccountedRun, number: int, runs: int) -> str:
    steps = ", ".join(
        f"{s.step} {s.state.value} {_exit_text(s.exit_code, s.signal)}"
        for s in run.steps
        if s.step != "extern"
    )
    where = f" on {run.nodes}" if run.nodes and run.nodes != "None assigned" else ""
    reason = f", reason {run.reason}" if run.reason and run.reason != "None" else ""
    line = f"run {number} of {runs}: {run.state.value}{where}, exit {_exit_text(run.exit_code, run.signal)}"
    line += f", ended {_when(run.end_time)}" if run.end_time else ""
    return line + reason + (f"; steps: {steps}" if steps else "")


def _exit_text(code: int | None, signal: int | None) -> str:
    """As scontrol and sacct print an exit code: CODE:SIGNAL."""
    return f"{code or 0}:{signal or 0}"


def _when(epoch: int | None) -> str:
    """As scontrol prints a time (the local clock's)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch)) if epoch else ""


def _uid(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return int(user) if user.isdigit() else None


def scan_hang_verdict(text: str, source: str, restart: int | None = None) -> Finding | None:
    """The watchdog's verdict.json (hpkit.runtime.watchdog.hang_watchdog): culprit, node, top frame, stacks folder."""
    try:
        data = json_text.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("line"), str):
        return None
    number = next(
        (i for i, raw in enumerate(text.splitlines(), 1) if raw.lstrip().startswith('"line":')),
        None,
    )
    line = text.splitlines()[number - 1] if number else json.dumps(data["line"])
    culprits = data.get("culprits") or []
    rank = int(culprits[0]) if len(culprits) == 1 else None
    nodes = data.get("nodes") or {}
    node = nodes.get(str(rank)) if rank is not None and isinstance(nodes, dict) else None
    if data.get("reason") == "store" and isinstance(data.get("store_node"), str) and data["store_node"]:
        # The node that serves the watchdog's store stopped answering: the node is the culprit, whatever
        # ranks it held.
        rank, node = None, data["store_node"]
    return Finding(
        HANG_VERDICT,
        (Evidence(source, number, line),),
        rank=rank,
        node=node,
        detail=data["line"],
        where=str(data.get("stacks", "")),
        restart=restart,
    )


def scan_runs_file(lines: Iterable[str], source: str) -> list[Finding]:
    """The runs file the job script keeps (`nodes LIST`, `requeued-by-hpkit K`)."""
    found = []
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if match := re.fullmatch(r"requeued-by-hpkit (\d+)", line):
            found.append(
                Finding(REQUEUE, (Evidence(source, number, line),), detail=f"restart {match.group(1)}")
            )
    return found


def scan_metrics(lines: Iterable[str], source: str) -> list[Finding]:
    """The metrics JSONL: its last run's end record, or its last step when the run did not end by itself."""
    last_step: Finding | None = None
    end: Finding | None = None
    for number, raw in enumerate(lines, 1):
        try:
            data = json_text.loads(raw)
            record = (
                parse_record(data) if isinstance(data, dict) and isinstance(data.get("step"), int) else None
            )
        except (ValueError, TypeError, KeyError):
            continue
        ev = Evidence(source, number, raw.rstrip("\r\n"))
        if isinstance(record, StartEvent):
            last_step, end = None, None
        elif isinstance(record, StepRecord):
            last_step = Finding(LAST_STEP, (ev,), detail=f"step {record.step}")
        elif isinstance(record, EndEvent):
            if record.stopped_by_signal is None:
                end = Finding(TRAIN_DONE, (ev,), detail=f"step {record.step}")
            else:
                end = Finding(
                    TRAIN_STOPPED,
                    (ev,),
                    detail=job_events.stopping_text(record.step, record.stopped_by_signal),
                    signal=record.stopped_by_signal,
                )
    return [f for f in (end, last_step if end is None else None) if f is not None]


@dataclass(frozen=True)
class JobEvents:
    """What the job's events file says: its findings (the last run's), and where to read the rest."""

    findings: list[Finding]
    logs: dict[str, int]  # each log file's size when the last step (or run) started: its lines start there
    hangs_dir: str | None = None
    launcher: str | None = None


def scan_events(lines: Iterable[str], source: str) -> JobEvents:
    """The events file of hpkit's supervisor (hpkit.job_events): the last run's, from its last step's start.

    A restart in the allocation starts the step over: what the earlier attempt did is over, except that it
    was restarted (a hang verdict that was acted on is not the job's end)."""
    found: list[Finding] = []
    logs: dict[str, int] = {}
    hangs_dir = launcher = None
    for number, line, event in job_events.read(lines):
        kind = event["type"]
        evidence = (Evidence(source, number, line),)
        restart = event.get("restart") if isinstance(event.get("restart"), int) else None
        if isinstance(event.get("logs"), dict):
            logs = {str(k): int(v) for k, v in event["logs"].items() if isinstance(v, int)}
        if kind == job_events.RUN_STARTED:
            found = [Finding(RUN_START, evidence, detail=str(event.get("nodes", "")), restart=restart)]
            hangs_dir = event.get("hangs_dir") or hangs_dir
            launcher = event.get("launcher") or launcher
            lost = [str(n) for n in event.get("lost_nodes") or []]
            if event.get("requeued_by") == "slurm" and lost:
                found.append(Finding(REQUEUED_AFTER_NODE, evidence, node=",".join(lost), restart=restart))
        elif kind == job_events.USR1:
            found.append(Finding(USR1, evidence))
        elif kind == job_events.RESTART:
            found = [f for f in found if f.kind in (RUN_START, HANG_RESTARTED)]
            if event.get("verdict"):
                found.append(
                    Finding(HANG_RESTARTED, evidence, where=job_events.verdict_folder(event["verdict"]))
                )
        elif kind == job_events.REQUEUE:
            detail = f"restart {event.get('to_restart')} of {event.get('max_restarts')}"
            found.append(Finding(REQUEUE, evidence, detail=detail))
        elif kind == job_events.NODE_LOST:
            found += [
                Finding(NODE_LOST, evidence, node=str(n), exit_code=event.get("exit")) for n in event["nodes"]
            ]
        elif kind == job_events.END:
            found += _end_findings(event, evidence)
    return JobEvents(found, logs, hangs_dir, launcher)


def _end_findings(event: dict, evidence: tuple[Evidence, ...]) -> list[Finding]:
    outcome = event.get("outcome")
    if outcome == job_events.PROGRAM_FAILED:
        return [Finding(PROGRAM_FAILED, evidence, detail=f"exit {event.get('exit')}")]
    if outcome in (job_events.HANG_BUDGET_SPENT, job_events.BUDGET_SPENT) and event.get("verdict"):
        return [Finding(HANG_END, evidence, where=job_events.verdict_folder(event["verdict"]))]
    if outcome == job_events.NODE_LOST_UNHANDLED:
        return [Finding(NODE_LOST, evidence, node=str(n)) for n in event.get("nodes") or []]
    return []
