"""Talking to Slurm: submit, inspect, cancel, wait.

Two backends share one small interface: the Slurm CLI (always available where jobs can be
submitted) and pyslurm, used only when its build matches the cluster's Slurm major.minor — a
mismatched pyslurm fails in confusing ways, so we refuse it and say why.
"""

from __future__ import annotations

import enum
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hpkit.errors import SlurmError

CLI_TIMEOUT_S = 30


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

    def summary(self) -> str:
        parts = [f"job {self.job_id} ({self.name}): {self.state.value}"]
        if self.state.finished and self.exit_code is not None:
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

    def cancel(self, job_id: str) -> None: ...


def _run(
    args: list[str], env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    if shutil.which(args[0]) is None:
        raise SlurmError(
            f"{args[0]} not found: run on a Slurm login node, or start the local cluster with `make cluster-up` "
            "and export SLURM_CONF"
        )
    try:
        proc = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            env=dict(env) if env is not None else None,
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{' '.join(args[:2])} did not answer in {CLI_TIMEOUT_S} s: is slurmctld up?"
        ) from None
    if check and proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        last = message[-1] if message else f"exit {proc.returncode}"
        hint = ""
        if "configuration source" in last:
            hint = (
                "; point SLURM_CONF at the cluster's slurm.conf "
                "(the local cluster's is .dev-cluster/etc/slurm.conf after `make cluster-up`)"
            )
        raise SlurmError(f"{' '.join(args[:2])} failed: {last}{hint}")
    return proc


def slurm_version() -> tuple[int, int]:
    proc = _run(["sinfo", "--version"])
    match = re.search(r"(\d+)\.(\d+)", proc.stdout)
    if not match:
        raise SlurmError(f"cannot read the Slurm version from {proc.stdout.strip()!r}")
    return int(match.group(1)), int(match.group(2))


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


class CliBackend:
    """The Slurm command-line tools, with their JSON output where this Slurm has it."""

    name = "cli"

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = env
        self._version: tuple[int, int] | None = None

    @property
    def version(self) -> tuple[int, int]:
        if self._version is None:
            self._version = slurm_version()
        return self._version

    def submit(self, script: Path) -> str:
        proc = _run(["sbatch", "--parsable", str(script)], env=self.env)
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
        return job_id

    def cancel(self, job_id: str) -> None:
        _run(["scancel", job_id], env=self.env)

    def info(self, job_id: str) -> JobInfo:
        info = self._from_controller(job_id)
        if info is None:
            info = self._from_sacct(job_id)
        if info is None:
            raise SlurmError(f"job {job_id} is unknown to slurmctld and to sacct")
        return info

    def _from_controller(self, job_id: str) -> JobInfo | None:
        record = self._json_record(job_id)
        proc = _run(["scontrol", "show", "job", "-o", job_id], env=self.env, check=False)
        text = proc.stdout.strip()
        if proc.returncode != 0 or not text:
            return None
        fields = parse_scontrol_record(text.splitlines()[0])
        stdout = fields.get("StdOut") or None  # scontrol expands %j/%x, the JSON does not
        if record is not None:
            exit_code, signal = _split_exit(_json_int(record.get("exit_code")))
            return JobInfo(
                job_id=job_id,
                name=str(record.get("name", "")),
                state=JobState.parse(_json_state(record.get("job_state"))),
                exit_code=exit_code,
                signal=signal,
                reason=str(record.get("state_reason", "")),
                nodes=str(record.get("nodes", "")),
                stdout=stdout,
            )
        code, _, sig = fields.get("ExitCode", "").partition(":")
        return JobInfo(
            job_id=job_id,
            name=fields.get("JobName", ""),
            state=JobState.parse(fields.get("JobState", "")),
            exit_code=int(code) if code.isdigit() else None,
            signal=int(sig) if sig.isdigit() else None,
            reason=fields.get("Reason", ""),
            nodes=fields.get("NodeList", ""),
            stdout=stdout,
        )

    def _json_record(self, job_id: str) -> dict | None:
        # 23.02 added `scontrol show job --json ID`; 22.05's `squeue --json` ignores filters, so we
        # pick our job out of the full list.
        if self.version >= (23, 2):
            args = ["scontrol", "show", "job", "--json", job_id]
        else:
            args = ["squeue", "--json"]
        proc = _run(args, env=self.env, check=False)
        if proc.returncode != 0:
            return None
        try:
            jobs = json.loads(proc.stdout).get("jobs", [])
        except json.JSONDecodeError:
            return None
        for job in jobs:
            if str(job.get("job_id")) == job_id:
                return job
        return None

    def _from_sacct(self, job_id: str) -> JobInfo | None:
        if shutil.which("sacct") is None:
            return None
        # Without slurmdbd only the job-completion log answers (`sacct -c`), and not in JSON.
        for extra in ([], ["-c"]):
            proc = _run(
                [
                    "sacct",
                    *extra,
                    "-n",
                    "-P",
                    "-X",
                    "-j",
                    job_id,
                    "-o",
                    "JobID,JobName,State,ExitCode,NodeList",
                ],
                env=self.env,
                check=False,
            )
            for line in proc.stdout.splitlines():
                cols = line.split("|")
                if proc.returncode == 0 and len(cols) >= 4 and cols[0].split(".")[0] == job_id:
                    code, _, sig = cols[3].partition(":")
                    return JobInfo(
                        job_id=job_id,
                        name=cols[1],
                        state=JobState.parse(cols[2]),
                        exit_code=int(code) if code.isdigit() else None,
                        signal=int(sig) if sig.isdigit() else None,
                        nodes=cols[4] if len(cols) > 4 else "",
                    )
        return None


def _json_int(value: object) -> int | None:
    # OpenAPI v0.0.38 gives ints; later versions wrap numbers as {"set": true, "number": N}
    # or exit codes as {"return_code": {...}, "signal": {...}}.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        if "return_code" in value:
            code = _json_int(value.get("return_code"))
            sig = (
                _json_int((value.get("signal") or {}).get("id"))
                if isinstance(value.get("signal"), dict)
                else 0
            )
            return None if code is None else (code << 8) | (sig or 0)
        if value.get("set", True) and "number" in value:
            return _json_int(value["number"])
    return None


def _json_state(value: object) -> str:
    if isinstance(value, list):  # 23.02+: a list of flags, the base state first
        return str(value[0]) if value else ""
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
    """auto: pyslurm when a matching build is importable, else the CLI."""
    if name == "cli":
        return CliBackend()
    module, why = pyslurm_status()
    if name == "pyslurm":
        if module is None:
            raise SlurmError(f"the pyslurm backend is unavailable: {why}")
        return PyslurmBackend(module)
    if name != "auto":
        raise SlurmError(f"unknown backend {name!r}: use auto, cli or pyslurm")
    return PyslurmBackend(module) if module is not None else CliBackend()


def wait(
    backend: Backend,
    job_id: str,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    on_change: Callable[[JobInfo, float], None] | None = None,
    on_poll: Callable[[JobInfo], None] | None = None,
) -> JobInfo:
    """Poll until the job ends. sbatch --wait polls every ~10 s; we poll ourselves, faster."""
    start = time.monotonic()
    last: JobInfo | None = None
    while True:
        info = backend.info(job_id)
        elapsed = time.monotonic() - start
        if on_change and (last is None or info.state != last.state):
            on_change(info, elapsed)
        last = info
        if on_poll:
            on_poll(info)
        if info.state.finished:
            return info
        if timeout_s is not None and elapsed > timeout_s:
            raise SlurmError(f"job {job_id} still {info.state.value} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def print_progress(info: JobInfo, elapsed: float) -> None:
    print(f"[{elapsed:6.1f}s] {info.summary()}", file=sys.stderr, flush=True)
