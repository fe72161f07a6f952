"""Talking to Slurm: submit, inspect, cancel, wait.

Two backends share one small interface: the Slurm CLI (always available where jobs can be
submitted, and the default) and pyslurm, only when asked for and only when its build matches the
cluster's Slurm major.minor — a mismatched pyslurm fails in confusing ways, so we refuse it and say why.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from hpkit.errors import SlurmError
from hpkit.slurm import client


class TransientSlurmError(SlurmError):
    """The controller did not answer this time (down, restarting, overloaded): worth asking again."""


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    REQUEUED = "REQUEUED"
    RESIZING = "RESIZING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> JobState:
        # sacct writes "CANCELLED by 0"; some versions abbreviate (CA, CD, F, ...).
        word = text.strip().split()[0].upper() if text.strip() else ""
        word = _STATE_CODES.get(word, word)
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_STATE_CODES = {
    "PD": "PENDING",
    "CF": "CONFIGURING",
    "R": "RUNNING",
    "CG": "COMPLETING",
    "S": "SUSPENDED",
    "RQ": "REQUEUED",
    "CD": "COMPLETED",
    "F": "FAILED",
    "CA": "CANCELLED",
    "TO": "TIMEOUT",
    "NF": "NODE_FAIL",
    "PR": "PREEMPTED",
    "OOM": "OUT_OF_MEMORY",
    "BF": "BOOT_FAIL",
    "DL": "DEADLINE",
}
_FINISHED = {
    JobState.COMPLETED,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.TIMEOUT,
    JobState.NODE_FAIL,
    JobState.PREEMPTED,
    JobState.OUT_OF_MEMORY,
    JobState.BOOT_FAIL,
    JobState.DEADLINE,
}


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    name: str
    state: JobState
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    nodes: str = ""
    stdout: str | None = None
    user: str = ""
    node_count: int | None = None
    start_time: int | None = None  # Unix seconds; None before the job starts
    end_time: int | None = None  # expected end while it runs (start + time limit)
    time_limit_min: int | None = None  # None: UNLIMITED
    # The job's requeue flag (sbatch --requeue, JobRequeue=1 by default): Slurm queues it again when it is
    # preempted. False where the record does not say (sacct's, pyslurm's).
    requeue: bool = False

    @property
    def requeued(self) -> bool:
        """Preempted, and Slurm queues it again: it will run again, it has not failed. (Under PreemptMode=CANCEL
        the flag is set but the job has ended: `wait` sees so once the controller forgets it, from sacct.)"""
        return self.state == JobState.PREEMPTED and self.requeue

    @property
    def ended(self) -> bool:
        """It will not run again: a finished state, except a preemption that Slurm requeues."""
        return self.state.finished and not self.requeued

    @property
    def state_text(self) -> str:
        """The state as hpkit shows it: Slurm's word, and for a preemption whether the job is requeued."""
        if self.state != JobState.PREEMPTED:
            return self.state.value
        return f"{self.state.value} (requeued)" if self.requeue else f"{self.state.value} (not requeued)"

    def summary(self) -> str:
        parts = [f"job {self.job_id} ({self.name}): {self.state_text}"]
        if self.ended and self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}" + (f", signal {self.signal}" if self.signal else ""))
        if self.reason and self.reason not in ("None", "(null)"):
            parts.append(f"reason {self.reason}")
        if self.nodes and self.nodes not in ("(null)", "None assigned"):
            parts.append(f"on {self.nodes}")
        return ", ".join(parts)


class Backend(Protocol):
    name: str

    def submit(self, script: Path) -> str: ...

    def info(self, job_id: str) -> JobInfo: ...

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobInfo]: ...

    def cancel(self, job_id: str) -> None: ...


def slurm_version(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    return client.version(env)


def _split_exit(raw: int | None) -> tuple[int | None, int | None]:
    """Slurm's JSON exit_code is a wait status: exit code in the high byte, signal in the low bits."""
    if raw is None:
        return None, None
    return (raw >> 8) & 0xFF, raw & 0x7F


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one `scontrol show job -o` record. Values may hold spaces (Command=...), so split on keys."""
    fields: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields[match.group(1)] = line[match.end() : end].strip()
    return fields


def job_record(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The controller's record of a job (`scontrol show job -o`), or None once it has forgotten the job."""
    line = client.show_job_line(job_id, env)
    return parse_scontrol_record(line) if line else None


def node_states(partition: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each node's short state as sinfo prints it (idle, mix, down*, drain, ...), in one partition or the default."""
    answer = client.node_states(partition=partition, env=env)
    client.raise_for(answer)
    rows = (line.split() for line in answer.out.splitlines())
    return {row[0]: row[1] for row in rows if len(row) >= 2}


class CliBackend:
    """The Slurm command-line tools, with their JSON output where this Slurm has it."""

    name = "cli"

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = env
        self._version: tuple[int, int] | None = None
        self._stdout_cache: dict[str, str] = {}
        self._no_slurmdbd = False
        # The last poll's controller records, by job id, and the ids it asked for: a caller that needs
        # more of a job's record (its script, working directory, restarts) reads it here, not with a
        # second call (polled_fields).
        self.records: dict[str, dict] = {}
        self.asked: frozenset[str] = frozenset()

    @property
    def version(self) -> tuple[int, int]:
        if self._version is None:
            self._version = slurm_version(self.env)  # the cluster this backend asks, whatever PATH says
        return self._version

    def submit(self, script: Path) -> str:
        return client.submit(script, self.env)

    def cancel(self, job_id: str) -> None:
        client.cancel(job_id, self.env)

    def info(self, job_id: str) -> JobInfo:
        info = self.poll([job_id]).get(job_id)
        if info is None:
            raise SlurmError(f"job {job_id} is unknown to slurmctld and to sacct")
        return info

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        """Every job in one controller call (`squeue --json`), then one sacct call for those that have
        left the controller. Jobs neither knows are missing from the result.

        Raises TransientSlurmError when the controller does not answer: the caller decides how long
        to keep trying.
        """
        wanted = [str(j) for j in job_ids]
        records = self.queue(wanted)
        self.records, self.asked = records, frozenset(wanted)
        found = {
            job_id: self._from_record(as_task(record, job_id))
            for job_id in wanted
            if (record := records.get(job_id))
        }
        gone = [j for j in wanted if j not in found]
        if gone:
            found.update(self._from_sacct(gone))
        return found

    def queue(self, job_ids: Sequence[str] | None = None) -> dict[str, dict]:
        """The controller's records (squeue --json), by job id: all of them, or those named.

        22.05's `squeue --json` ignores filters and returns every job, so we filter here; later
        versions honour `--jobs` and, like plain squeue, leave out ended jobs unless asked for every
        state (24.11: a COMPLETED job named by `--jobs` is simply missing). A controller that does not
        answer makes squeue exit 0 with an `errors` list in the JSON (22.05) or exit non-zero: both
        raise TransientSlurmError.
        """
        args = []
        if self.version >= (23, 2):
            args.append("--states=all")
            if job_ids:
                args.append(f"--jobs={','.join(job_ids)}")
        try:
            proc = client.queue_json(args, self.env)
        except SlurmError as exc:  # a timeout: the controller is busy or down
            raise TransientSlurmError(str(exc)) from None
        try:
            data = json.loads(proc.stdout) if proc.stdout.strip() else {}
        except json.JSONDecodeError:
            data = {}
        errors = [e for e in data.get("errors", []) if isinstance(e, dict)] if isinstance(data, dict) else []
        if proc.returncode != 0 or errors or not isinstance(data, dict) or "jobs" not in data:
            text = (proc.stderr or "").strip().splitlines()
            why = (
                errors[0].get("description", "")
                if errors
                else (text[-1] if text else f"exit {proc.returncode}")
            )
            if "Invalid job id" in why and job_ids:
                if len(job_ids) == 1:
                    return {}  # 23.02+: the one job named has left the controller
                # some named jobs are gone: ask for the whole queue instead (still one more call)
                return {j: r for j, r in self.queue(None).items() if j in set(job_ids)}
            raise TransientSlurmError(f"squeue failed: {why}")
        wanted = set(job_ids) if job_ids else None
        return {
            name: job
            for job in data["jobs"]
            for name in record_names(job)
            if wanted is None or name in wanted
        }

    def _from_record(self, record: dict, with_stdout: bool = True) -> JobInfo:
        task = array_task(record)
        job_id = f"{task[0]}_{task[1]}" if task else str(record.get("job_id"))  # as squeue shows it
        exit_code, signal = _split_exit(_json_int(record.get("exit_code")))
        return JobInfo(
            job_id=job_id,
            name=str(record.get("name", "")),
            state=JobState.parse(_json_state(record.get("job_state"))),
            exit_code=exit_code,
            signal=signal,
            reason=str(record.get("state_reason", "")),
            nodes=str(record.get("nodes", "")),
            stdout=self._stdout(record) if with_stdout else None,
            user=str(record.get("user_name", "")),
            node_count=_json_int(record.get("node_count")),
            start_time=_json_int(record.get("start_time")) or None,
            end_time=_json_int(record.get("end_time")) or None,
            time_limit_min=_json_int(record.get("time_limit")),
            requeue=record.get("requeue") is True,
        )

    def _stdout(self, record: dict) -> str | None:
        """The job's output file: the JSON holds the pattern as given (logs/%x-%j.out), scontrol the
        expanded path. Expand the common patterns here; ask scontrol once per job for the rest."""
        task = array_task(record)
        job_id = f"{task[0]}_{task[1]}" if task else str(record.get("job_id"))
        if job_id in self._stdout_cache:
            return self._stdout_cache[job_id]
        pattern = str(record.get("standard_output") or "")
        path = expand_output_pattern(pattern, record)
        if path is None and pattern:
            line = client.show_job_line(job_id, self.env)
            path = parse_scontrol_record(line).get("StdOut") or None if line else None
        if path is not None:
            self._stdout_cache[job_id] = path
        return path

    def _from_sacct(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        if not client.has_sacct(self.env):
            return {}
        found: dict[str, JobInfo] = {}
        # Without slurmdbd only the job-completion log answers (`sacct -c`), and not in JSON; once
        # accounting has said it is off, later polls go to the log directly.
        for extra in ([], ["-c"]):
            missing = [j for j in job_ids if j not in found]
            if not missing:
                break
            if not extra and self._no_slurmdbd:
                continue
            if not extra:
                found.update(self._from_accounting(missing))
                continue
            proc = client.sacct(
                [
                    *extra,
                    "-n",
                    "-P",
                    "-X",
                    "-j",
                    ",".join(missing),
                    "-o",
                    "JobID,JobName,State,ExitCode,NodeList",
                ],
                self.env,
            )
            if proc.returncode != 0:
                self._no_slurmdbd = self._no_slurmdbd or not extra
                continue
            for line in proc.stdout.splitlines():
                cols = line.split("|")
                job_id = cols[0].split(".")[0]
                if len(cols) >= 4 and job_id in missing:
                    code, _, sig = cols[3].partition(":")
                    # The completion log keeps one line per run of a requeued job: the last one wins.
                    found[job_id] = JobInfo(
                        job_id=job_id,
                        name=cols[1],
                        state=JobState.parse(cols[2]),
                        exit_code=int(code) if code.isdigit() else None,
                        signal=int(sig) if sig.isdigit() else None,
                        nodes=cols[4] if len(cols) > 4 else "",
                    )
        return found

    def _from_accounting(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        try:
            return {j: a.info() for j, a in accounting(job_ids, self.env).items() if j in job_ids}
        except AccountingUnavailable:
            self._no_slurmdbd = True
        except SlurmError:
            pass  # slurmdbd did not answer this time: the completion log may
        return {}


def polled_fields(backend: Backend, job_id: str) -> tuple[bool, dict[str, str] | None]:
    """(asked, fields): whether the backend's last poll asked the controller for this job, and what it said
    in `scontrol show job`'s words (Command, WorkDir, Restarts; None: the controller had forgotten the job).
    Finding a job's files then costs no second call; where the poll did not ask, the caller asks scontrol."""
    if not isinstance(backend, CliBackend) or str(job_id) not in backend.asked:
        return False, None
    record = backend.records.get(str(job_id))
    if record is None:
        return True, None
    return True, {
        "Command": str(record.get("command") or ""),
        "WorkDir": str(record.get("current_working_directory") or ""),
        "Restarts": str(_json_int(record.get("restart_cnt")) or 0),
    }


def user_jobs(backend: CliBackend, user: str | None = None) -> list[JobInfo]:
    """The user's jobs the controller knows, oldest first, from one squeue call."""
    import getpass

    user = user or getpass.getuser()
    # A job array's task is in the queue under two names (its id and JOB_TASK): one row each.
    records = {id(r): r for r in backend.queue().values()}
    rows = [
        backend._from_record(r, with_stdout=False) for r in records.values() if r.get("user_name") == user
    ]
    return sorted(rows, key=lambda r: int(r.job_id.split("_")[0]) if r.job_id.split("_")[0].isdigit() else 0)


def expand_output_pattern(pattern: str, record: dict) -> str | None:
    """sbatch's filename pattern for one job, or None when it uses one that needs the controller."""
    if not pattern:
        return None
    values = {
        "j": str(record.get("job_id", "")),
        "x": str(record.get("name", "")),
        "u": str(record.get("user_name", "")),
        "%": "%",
    }
    if task := array_task(record):  # a task of a job array (%A_%a)
        values.update(A=task[0], a=task[1])
    out = []
    i = 0
    while i < len(pattern):
        if pattern[i] != "%":
            out.append(pattern[i])
            i += 1
            continue
        match = re.match(r"%(\d*)([A-Za-z%])", pattern[i:])
        if not match or match.group(2) not in values:
            return None
        value = values[match.group(2)]
        width = int(match.group(1) or 0)
        out.append(value.zfill(width) if value.isdigit() else value)
        i += match.end()
    path = "".join(out)
    if not path.startswith("/"):
        path = str(Path(str(record.get("current_working_directory") or ".")) / path)
    return path


NO_VAL = 0xFFFFFFFE  # Slurm's "not set" for 32-bit fields (an array record that is not one task)


def _id(value: object) -> int | None:
    if isinstance(value, str):
        return int(value) if value.isdigit() else None
    return _json_int(value)


def array_task(record: Mapping[str, object]) -> tuple[str, str] | None:
    """(array job id, task number) of a record that is one task of a job array, else None."""
    array, task = _id(record.get("array_job_id")), _id(record.get("array_task_id"))
    if not array or task is None or task >= NO_VAL:
        return None
    return str(array), str(task)


def record_names(record: Mapping[str, object]) -> list[str]:
    """What a controller record answers to: its job id; a job array's task also to JOB_TASK, and the array's
    record of tasks not yet started (array_task_string 2-3%2) to JOB_TASK for each of them."""
    names = [str(record.get("job_id"))]
    if task := array_task(record):
        return [*names, f"{task[0]}_{task[1]}"]
    array, pending = _id(record.get("array_job_id")), str(record.get("array_task_string") or "")
    if array:
        for part in pending.split("%")[0].split(","):
            first, _, last = part.partition("-")
            if first.isdigit() and (not last or last.isdigit()):
                names += [f"{array}_{t}" for t in range(int(first), int(last or first) + 1)]
    return names


def as_task(record: dict, name: str) -> dict:
    """The record for `name`: a task of a job array not started yet (JOB_TASK) is in its array's record, which
    names no task; the copy names it, so that its id and log (%A_%a) are the task's."""
    array, _, task = name.partition("_")
    if not task.isdigit() or array_task(record) is not None or str(_id(record.get("array_job_id"))) != array:
        return record
    return {**record, "array_task_id": int(task)}


def _json_int(value: object) -> int | None:
    """A number from any OpenAPI version of Slurm's JSON, None when unset or infinite.

    v0.0.38 (22.05) gives ints (an exit code as a wait status); v0.0.39+ (23.02 .. 24.11's v0.0.42) wrap
    numbers as {"set", "infinite", "number"} and exit codes as {"status": [...], "return_code": {number},
    "signal": {"id": {number}, "name"}}, returned here as a wait status. A job killed by a signal has
    no return code (`set` false) and its signal set: (0, signal), as 22.05's wait status says.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        if "return_code" in value:
            code = _json_int(value.get("return_code"))
            signal = value.get("signal")
            sig = _json_int(signal.get("id")) if isinstance(signal, dict) else None
            if code is None and sig is None:
                return None
            return ((code or 0) << 8) | ((sig or 0) & 0x7F)
        if value.get("set", True) and not value.get("infinite", False) and "number" in value:
            return _json_int(value["number"])
    return None


# Flags that 22.05's job_state string (and squeue's %T) gives before the base state, in its order: a
# cancelled job whose steps are still being killed is COMPLETING, not yet CANCELLED.
_STATE_FLAGS_FIRST = ("COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED")


def _json_state(value: object) -> str:
    if isinstance(
        value, list
    ):  # 23.02+: the base state first, then flags (24.11: ["CANCELLED", "COMPLETING"])
        words = [str(v) for v in value]
        return next((flag for flag in _STATE_FLAGS_FIRST if flag in words), words[0] if words else "")
    return str(value or "")


class PyslurmBackend:
    """pyslurm ≥ 23.02's object API for status and cancel (submission stays with sbatch); only chosen
    when its version matches the running Slurm."""

    name = "pyslurm"

    def __init__(self, module):
        self.pyslurm = module

    def submit(self, script: Path) -> str:
        # Through sbatch, not pyslurm's JobSubmitDescription: pyslurm re-parses #SBATCH lines itself
        # and (pyslurm/core/job/submission.pyx, 23.x) parses --signal but never applies it, which would
        # silently drop the preemption warning. sbatch reads the script exactly as a user's would.
        return CliBackend().submit(script)

    def info(self, job_id: str) -> JobInfo:
        try:
            job = self.pyslurm.Job.load(int(job_id))
        except Exception as exc:  # pyslurm raises its own RPCError for unknown jobs
            raise SlurmError(f"job {job_id}: {exc}") from None
        return JobInfo(
            job_id=job_id,
            name=str(job.name or ""),
            state=JobState.parse(str(job.state or "")),
            exit_code=job.exit_code,
            signal=getattr(job, "exit_code_signal", None),
            reason=str(job.state_reason or ""),
            nodes=str(job.allocated_nodes or ""),
            stdout=job.standard_output,
        )

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        found = {}
        for job_id in job_ids:
            try:
                found[str(job_id)] = self.info(str(job_id))
            except SlurmError:
                continue
        return found

    def cancel(self, job_id: str) -> None:
        self.pyslurm.Job(int(job_id)).cancel()


def pyslurm_status() -> tuple[object | None, str]:
    """(module, why): the pyslurm module when its build matches the running Slurm, else None and why not."""
    try:
        import pyslurm  # type: ignore[import-not-found]
    except ImportError:
        return None, "pyslurm is not installed"
    except Exception as exc:  # a build against another libslurm fails at import with a linker error
        return None, f"pyslurm does not load: {exc}"
    version = str(getattr(pyslurm, "__version__", ""))
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return None, f"cannot read pyslurm's version ({version!r})"
    wanted = (int(match.group(1)), int(match.group(2)))
    try:
        running = slurm_version()
    except SlurmError as exc:
        return None, str(exc)
    if wanted != running:
        return None, (
            f"pyslurm {version} is built for Slurm {wanted[0]}.{wanted[1]:02d}, the cluster runs "
            f"{running[0]}.{running[1]:02d}: install a matching pyslurm or use the CLI backend"
        )
    if not hasattr(pyslurm, "JobSubmitDescription"):
        return None, f"pyslurm {version} predates the object API (23.02) that hpkit uses"
    return pyslurm, f"pyslurm {version} matches Slurm {running[0]}.{running[1]:02d}"


def get_backend(name: str = "auto") -> Backend:
    """auto and cli: the Slurm CLI; pyslurm only when asked for by name.

    pyslurm is half a backend (it submits through sbatch, polls one job per call, and reports fewer
    fields than `squeue --json`), so having it installed must not change what `auto` does.
    """
    if name in ("auto", "cli"):
        return CliBackend()
    if name != "pyslurm":
        raise SlurmError(f"unknown backend {name!r}: use auto, cli or pyslurm")
    module, why = pyslurm_status()
    if module is None:
        raise SlurmError(f"the pyslurm backend is unavailable: {why}")
    return PyslurmBackend(module)


# Seconds between polls as a job ages (since its last state change): quick at first, when states
# change fast, then rarer. Long jobs cost the controller one call per POLL_CAP_S, whatever their number.
POLL_STEPS = ((10.0, 1.0), (60.0, 2.0), (300.0, 5.0))
POLL_CAP_S = 10.0
# How long the controller may stay silent before `wait` gives up, and the fewest failed tries first.
OUTAGE_LIMIT_S = 120.0
OUTAGE_MIN_FAILURES = 3
# A job that neither squeue nor sacct knows this many polls in a row is reported as unknown.
UNKNOWN_POLLS = 3


def poll_interval(age_s: float, first_s: float = 1.0, cap_s: float = POLL_CAP_S) -> float:
    """Seconds to the next poll for a job whose state last changed `age_s` ago."""
    for until, interval in POLL_STEPS:
        if age_s < until:
            return min(max(first_s, interval), max(first_s, cap_s))
    return max(first_s, cap_s)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def wait_all(
    backend: Backend,
    job_ids: Sequence[str],
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    on_change: Callable[[JobInfo, float], None] | None = None,
    on_poll: Callable[[JobInfo], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    notify: Callable[[str], None] = _stderr,
    outage_limit_s: float = OUTAGE_LIMIT_S,
    tick_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, JobInfo]:
    """Poll until every job has ended: one Slurm call per poll for all of them, less often as they age.

    sbatch --wait polls every ~10 s whatever happens; we poll fast while states change. A controller
    that does not answer is retried with one message (and one when it answers again); only an outage
    longer than `outage_limit_s` (and OUTAGE_MIN_FAILURES tries) ends the wait. `on_tick` runs every
    `tick_s` between polls (the log follower), without asking Slurm anything.
    """
    start = clock()
    pending = list(dict.fromkeys(str(j) for j in job_ids))
    changed = dict.fromkeys(pending, start)
    last: dict[str, JobInfo] = {}
    done: dict[str, JobInfo] = {}
    unknown = dict.fromkeys(pending, 0)
    outage_since: float | None = None
    failures = 0

    def pause(seconds: float) -> None:
        until = clock() + seconds
        while (left := until - clock()) > 0:
            if on_tick:
                on_tick()
            sleep(min(tick_s, left))

    while True:
        now = clock()
        try:
            infos = backend.poll(pending)
        except TransientSlurmError as exc:
            failures += 1
            if outage_since is None:
                outage_since = now
                notify(f"hpkit: Slurm did not answer ({exc}); retrying for up to {outage_limit_s:.0f} s")
            down = now - outage_since
            if failures >= OUTAGE_MIN_FAILURES and down >= outage_limit_s:
                raise SlurmError(
                    f"Slurm has not answered for {down:.0f} s ({failures} tries): {exc}; "
                    "check slurmctld (`scontrol ping`) and wait again"
                ) from None
            pause(poll_interval(down, poll_s))
            continue
        if outage_since is not None:
            notify(f"hpkit: Slurm answers again after {now - outage_since:.0f} s")
            outage_since, failures = None, 0
        for job_id in pending:
            info = infos.get(job_id)
            if info is None:
                unknown[job_id] += 1
                if unknown[job_id] >= UNKNOWN_POLLS:
                    raise SlurmError(f"job {job_id} is unknown to slurmctld and to sacct")
                continue
            unknown[job_id] = 0
            previous = last.get(job_id)
            if previous is None or previous.state != info.state:
                changed[job_id] = now
                if on_change:
                    on_change(info, now - start)
            last[job_id] = info
            if on_poll:
                on_poll(info)
            if info.ended:  # a preempted job that Slurm requeues runs again: keep waiting
                done[job_id] = info
        pending = [j for j in pending if j not in done]
        if not pending:
            return {j: done[j] for j in dict.fromkeys(str(j) for j in job_ids)}
        elapsed = clock() - start
        if timeout_s is not None and elapsed > timeout_s:
            states = ", ".join(f"{j} {last[j].state.value}" for j in pending if j in last)
            raise SlurmError(f"still running after {timeout_s:.0f} s: {states or ', '.join(pending)}")
        # Any change, a job's end included, resets the interval: one job's end often moves the others.
        youngest = max(changed.values())
        pause(poll_interval(clock() - youngest, poll_s))


def wait(backend: Backend, job_id: str, **kwargs) -> JobInfo:
    """wait_all for one job."""
    return wait_all(backend, [job_id], **kwargs)[str(job_id)]


def print_progress(info: JobInfo, elapsed: float) -> None:
    print(f"[{elapsed:6.1f}s] {info.summary()}", file=sys.stderr, flush=True)


# Accounting (slurmdbd, read through `sacct --json`): the record of jobs that the controller has forgotten
# (MinJobAge after their end). This is the only place that runs sacct; the others call `accounting`.


class AccountingUnavailable(SlurmError):
    """This cluster keeps no accounting that sacct can read (no sacct here, accounting_storage/none, no slurmdbd)."""


@dataclass(frozen=True)
class AccountedStep:
    """One step of one run: `batch`, `extern`, `0`, ..."""

    step: str
    state: JobState
    exit_code: int | None = None
    signal: int | None = None
    nodes: str = ""


@dataclass(frozen=True)
class AccountedRun:
    """One run of a job as accounting keeps it; a requeued job has one per run, oldest first."""

    job_id: str  # as sbatch and squeue name it: "123", or "123_4" for task 4 of array job 123
    name: str
    state: JobState
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    nodes: str = ""
    start_time: int | None = None  # Unix seconds
    end_time: int | None = None
    elapsed_s: int | None = None
    workdir: str = ""
    cancelled_by: str = ""  # the user who asked for the cancel, where Slurm names one
    steps: tuple[AccountedStep, ...] = ()


@dataclass(frozen=True)
class JobAccounting:
    """Everything accounting knows of one job (one array task): its runs, oldest first."""

    job_id: str
    runs: tuple[AccountedRun, ...]

    @property
    def last(self) -> AccountedRun:
        return self.runs[-1]

    @property
    def requeues(self) -> int:
        return len(self.runs) - 1

    def info(self) -> JobInfo:
        """The last run as a JobInfo (what `poll` gives for jobs the controller still knows)."""
        run = self.last
        return JobInfo(
            job_id=self.job_id,
            name=run.name,
            state=run.state,
            exit_code=run.exit_code,
            signal=run.signal,
            reason=run.reason,
            nodes=run.nodes,
            start_time=run.start_time,
            end_time=run.end_time,
        )


# What sacct says on a cluster that keeps no accounting (AccountingStorageType=accounting_storage/none). A
# slurmdbd that does not answer ("Connection refused") is not this: it may answer the next poll.
_NO_ACCOUNTING = re.compile(r"accounting storage is disabled", re.I)


def accounting(
    job_ids: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = client.CLI_TIMEOUT_S
) -> dict[str, JobAccounting]:
    """Accounting's record of the jobs (`sacct --json -D -j ...`: every run of a requeued job), by job id; an
    array job's id gives its tasks, as "ID_TASK". Jobs accounting does not know are missing from the result.

    Raises AccountingUnavailable when this cluster keeps no accounting that sacct reads, SlurmError when sacct
    does not answer in `timeout_s`, fails otherwise, or gives unreadable JSON.
    """
    wanted = [str(j) for j in job_ids]
    if not wanted:
        return {}
    if not client.has_sacct(env):
        raise AccountingUnavailable("not found here (no Slurm client on PATH)")
    proc = client.sacct(["--json", "-D", "-j", ",".join(wanted)], env, timeout_s)
    lines = (proc.stderr or "").strip().splitlines()
    if proc.returncode != 0:
        last = lines[-1] if lines else f"exit {proc.returncode}"
        if _NO_ACCOUNTING.search(proc.stderr or ""):
            raise AccountingUnavailable(last)
        raise SlurmError(f"sacct --json failed: {last}")
    if not proc.stdout.strip() and _NO_ACCOUNTING.search(proc.stderr or ""):
        raise AccountingUnavailable(lines[-1])
    found = parse_sacct_json(proc.stdout)
    if found and needs_text_exit_codes(proc.stdout):
        args = ["-D", "-P", "-n", "-j", ",".join(wanted), "-o", "JobIDRaw,ExitCode"]
        text = client.sacct(args, env, timeout_s)
        if text.returncode == 0:
            found = parse_sacct_json(proc.stdout, text.stdout)
    return found


def needs_text_exit_codes(text: str) -> bool:
    """22.05's `sacct --json` (openapi/dbv0.0.38) gives every exit code as 0 (SUCCESS): a job that exited 3 and its
    steps included (tests/fixtures/sacct/22.05). Its text output has them right."""
    return "dbv0.0.38" in text  # "openapi\/dbv0.0.38": 22.05 escapes the slash


def parse_sacct_json(text: str, exit_codes: str | None = None) -> dict[str, JobAccounting]:
    """`sacct --json` of Slurm 22.05 (v0.0.38) to 24.11 (v0.0.42), by job id (array tasks as "ID_TASK").

    `exit_codes`: `sacct -D -P -n -o JobIDRaw,ExitCode` of the same jobs, whose exit codes replace the JSON's
    (22.05's are all 0: `needs_text_exit_codes`)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SlurmError(f"sacct --json gave no JSON: {exc}") from None
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise SlurmError("sacct --json gave no jobs list")
    runs: dict[str, list[tuple[int, AccountedRun]]] = {}
    codes = _text_exit_codes(exit_codes) if exit_codes is not None else None
    seen: dict[str, int] = {}
    for job in jobs:
        if isinstance(job, dict):
            run = _accounted_run(job)
            if codes is not None:
                # The text lists a job's runs in the JSON's order: the n-th run of a raw id is the n-th's codes.
                raw = str(_json_int(job.get("job_id")))
                seen[raw] = seen.get(raw, 0) + 1
                run = _with_exit_codes(run, codes.get((raw, seen[raw]), {}))
            submitted = _json_int((job.get("time") or {}).get("submission")) or 0
            runs.setdefault(run.job_id, []).append((submitted, run))
    return {
        job_id: JobAccounting(job_id, tuple(run for _, run in sorted(found, key=lambda pair: pair[0])))
        for job_id, found in runs.items()
    }


def _text_exit_codes(text: str) -> dict[tuple[str, int], dict[str, tuple[int | None, int | None]]]:
    """`JobIDRaw|ExitCode` lines: (raw job id, its run number from 1) -> {step ("" for the job): (code, signal)}."""
    found: dict[tuple[str, int], dict[str, tuple[int | None, int | None]]] = {}
    runs: dict[str, int] = {}
    for line in text.splitlines():
        raw, _, exit_code = line.strip().partition("|")
        job, _, step = raw.partition(".")
        if not job:
            continue
        if not step:
            runs[job] = runs.get(job, 0) + 1
        code, _, signal = exit_code.partition(":")
        value = (int(code) if code.isdigit() else None, int(signal) if signal.isdigit() else None)
        found.setdefault((job, max(runs.get(job, 1), 1)), {})[step] = value
    return found


def _with_exit_codes(run: AccountedRun, codes: dict[str, tuple[int | None, int | None]]) -> AccountedRun:
    if not codes:
        return run
    # A step that never reported (its node lost) has an empty ExitCode: the JSON's word stands.
    codes = {step: value for step, value in codes.items() if value != (None, None)}
    code, signal = codes.get("", (run.exit_code, run.signal))
    steps = tuple(
        replace(s, exit_code=codes[s.step][0], signal=codes[s.step][1] or None) if s.step in codes else s
        for s in run.steps
    )
    return replace(run, exit_code=code, signal=signal or None, steps=steps)


def _accounted_run(job: dict) -> AccountedRun:
    job_id = str(_json_int(job.get("job_id")) or "")
    array = job.get("array") or {}
    task = _json_int(array.get("task_id")) if isinstance(array, dict) else None
    array_id = _json_int(array.get("job_id")) if isinstance(array, dict) else None
    if task is not None and array_id:
        job_id = f"{array_id}_{task}"
    state = job.get("state") or {}
    times = job.get("time") or {}
    code, signal = _json_exit(job.get("exit_code"))
    if code is None and signal is None:
        code, signal = _json_exit(job.get("derived_exit_code"))
    start = _json_int(times.get("start"))
    end = _json_int(times.get("end"))
    steps = tuple(_accounted_step(s) for s in job.get("steps") or [] if isinstance(s, dict))
    return AccountedRun(
        job_id=job_id,
        name=str(job.get("name") or ""),
        state=JobState.parse(_json_state(state.get("current"))),
        reason=str(state.get("reason") or ""),
        exit_code=code,
        signal=signal,
        nodes=str(job.get("nodes") or ""),
        start_time=start or None,  # 0: never started
        end_time=end or None,
        elapsed_s=_json_int(times.get("elapsed")),
        workdir=str(job.get("working_directory") or ""),
        cancelled_by=str(job.get("kill_request_user") or ""),
        steps=steps,
    )


def _accounted_step(step: dict) -> AccountedStep:
    ids = step.get("step") or {}
    # 22.05: {"id": "batch"} or {"id": 0}; 24.11: {"id": "123.batch", "name": "batch"}
    raw = str(ids.get("id", "")) if isinstance(ids, dict) else str(ids)
    nodes = step.get("nodes") or {}
    code, signal = _json_exit(step.get("exit_code"))
    return AccountedStep(
        step=raw.rsplit(".", 1)[-1],
        state=JobState.parse(
            _json_state(
                (step.get("state") or "")
                if not isinstance(step.get("state"), dict)
                else step["state"].get("current")
            )
        ),
        exit_code=code,
        signal=signal,
        nodes=str(nodes.get("range") or ",".join(nodes.get("list") or []))
        if isinstance(nodes, dict)
        else str(nodes),
    )


def _json_exit(value: object) -> tuple[int | None, int | None]:
    """(exit code, signal) from sacct's exit_code object: 22.05's {"status", "return_code": N, "signal":
    {"signal_id"}} or 23.02+'s {"status": [...], "return_code": {number}, "signal": {"id": {number}}}."""
    if not isinstance(value, dict):
        return None, None
    code = _json_int(value.get("return_code"))
    signal = value.get("signal")
    sig = _json_int(signal.get("id", signal.get("signal_id"))) if isinstance(signal, dict) else None
    return code, sig or None
