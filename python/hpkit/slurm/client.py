"""The one place hpkit's Python runs Slurm's commands (sbatch, scancel, scontrol, squeue, sacct, sinfo).

Every call goes through `call` (never raises: an `Answer` says how it ended) or `run` (raises SlurmError with
one line naming the command and, where it helps, the fix). The named functions below are the calls hpkit makes;
each caller turns an `Answer` into its own words (a check's result, the supervisor's False, a launch error).
tests/unit/test_slurm_client.py fails when a module outside this one names one of these commands in an argv.

Standard library only: the runtime imports it on compute nodes (hpkit.runtime.env), before torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpkit.errors import SlurmError

# The commands only this module runs.
COMMANDS = frozenset({"sbatch", "scancel", "scontrol", "squeue", "sacct", "sinfo"})
SCONTROL, SINFO = "scontrol", "sinfo"
CLI_TIMEOUT_S = 30
# The node's own address: what slurmd is reached at, where a node name need not resolve in DNS.
_NODE_ADDR = re.compile(r"\bNodeAddr=(\S+)")


@dataclass(frozen=True)
class Answer:
    """How one command ended. rc is None when it did not run (missing, not executable) or ran past its timeout."""

    args: tuple[str, ...]
    rc: int | None
    out: str = ""
    err: str = ""
    missing: bool = False  # the program is on neither PATH nor the extra folders
    timed_out: bool = False
    os_error: str = ""  # why the program could not be started (permission, ...)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def command(self) -> str:
        return " ".join(self.args)


def program(name: str, env: Mapping[str, str] | None = None, extra_dirs: Iterable[Path] = ()) -> str | None:
    """The program on PATH (the environment the command will run in), else in one of extra_dirs."""
    found = shutil.which(name, path=(env if env is not None else os.environ).get("PATH", os.defpath))
    if found:
        return found
    for folder in extra_dirs:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def call(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout_s: float = CLI_TIMEOUT_S,
    extra_dirs: Iterable[Path] = (),
) -> Answer:
    """Run one Slurm command; never raises."""
    argv = tuple(args)
    on_path = program(argv[0], env)
    path = on_path or program(argv[0], env, extra_dirs)
    if path is None:
        return Answer(argv, None, missing=True)
    try:
        done = subprocess.run(
            list(argv) if on_path else [path, *argv[1:]],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return Answer(argv, None, timed_out=True)
    except OSError as exc:
        return Answer(argv, None, os_error=str(exc.strerror or exc))
    return Answer(argv, done.returncode, done.stdout, done.stderr)


def run(
    args: list[str],
    env: Mapping[str, str] | None = None,
    check: bool = True,
    timeout_s: float = CLI_TIMEOUT_S,
) -> subprocess.CompletedProcess:
    """Run one Slurm command for the job API: SlurmError (one line) when it is missing, does not answer, or (with
    `check`) fails."""
    answer = call(args, env, timeout_s)
    if answer.rc is None or check:
        raise_for(answer, timeout_s)
    return subprocess.CompletedProcess(list(args), answer.rc, answer.out, answer.err)


def raise_for(answer: Answer, timeout_s: float = CLI_TIMEOUT_S) -> None:
    """SlurmError, one line naming the command and where it helps the fix, unless the command succeeded."""
    args = answer.args
    if answer.missing:
        raise SlurmError(
            f"{args[0]} not found: run on a Slurm login node, or start the local cluster with `make cluster-up` "
            "and export SLURM_CONF"
        )
    if answer.timed_out:
        daemon = "slurmdbd" if args[0] == "sacct" else "slurmctld"
        raise SlurmError(f"{' '.join(args[:2])} did not answer in {timeout_s:.0f} s: is {daemon} up?")
    if answer.rc is None:
        raise SlurmError(f"{' '.join(args[:2])} failed: {answer.os_error}")
    if answer.rc != 0:
        message = (answer.err or answer.out).strip().splitlines()
        last = message[-1] if message else f"exit {answer.rc}"
        hint = ""
        if "configuration source" in last:
            hint = (
                "; point SLURM_CONF at the cluster's slurm.conf "
                "(the local cluster's is .dev-cluster/etc/slurm.conf after `make cluster-up`)"
            )
        raise SlurmError(f"{' '.join(args[:2])} failed: {last}{hint}")


def has_sacct(env: Mapping[str, str] | None = None) -> bool:
    return program("sacct", env) is not None


# The calls hpkit makes. Those that return an Answer leave the words to the caller.


def version(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """The cluster's Slurm major.minor (`sinfo --version`)."""
    proc = run(["sinfo", "--version"], env=env)
    match = re.search(r"(\d+)\.(\d+)", proc.stdout)
    if not match:
        raise SlurmError(f"cannot read the Slurm version from {proc.stdout.strip()!r}")
    return int(match.group(1)), int(match.group(2))


def submit(script: Path, env: Mapping[str, str] | None = None) -> str:
    proc = run(["sbatch", "--parsable", str(script)], env=env)
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job_id


def cancel(job_id: str, env: Mapping[str, str] | None = None) -> None:
    run(["scancel", job_id], env=env)


def show_job_line(job_id: str, env: Mapping[str, str] | None = None) -> str:
    """The controller's one-line record of a job (`scontrol show job -o`), "" once it has forgotten the job."""
    proc = run(["scontrol", "show", "job", "-o", job_id], env=env, check=False)
    lines = proc.stdout.strip().splitlines()
    return lines[0] if proc.returncode == 0 and lines else ""


def show_job(job_id: str, env: Mapping[str, str] | None = None) -> Answer:
    """`scontrol show job N` as Slurm prints it (several lines of Key=Value)."""
    return call(["scontrol", "show", "job", job_id], env)


def show_config(
    env: Mapping[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S, extra_dirs: Iterable[Path] = ()
) -> Answer:
    """`scontrol show config`: one `Key = value` a line."""
    return call(["scontrol", "show", "config"], env, timeout_s, extra_dirs)


def show_topology(
    env: Mapping[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S, extra_dirs: Iterable[Path] = ()
) -> Answer:
    return call(["scontrol", "show", "topology"], env, timeout_s, extra_dirs)


def show_node(node: str, env: Mapping[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S) -> Answer:
    """`scontrol show node -o NODE`: the node's record on one line (read it with `node_addr`)."""
    return call(["scontrol", "show", "node", "-o", node], env, timeout_s)


def node_addr(record: str) -> str | None:
    """The NodeAddr of a `scontrol show node` record, None where it names none."""
    match = _NODE_ADDR.search(record)
    return match.group(1) if match and match.group(1) not in ("(null)", "") else None


def node_states(
    nodelist: str = "",
    partition: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = CLI_TIMEOUT_S,
) -> Answer:
    """`sinfo -h -N -o '%N %t'`: one line per node, its name and short state (idle, mix, down*, drain, ...), of
    the nodes named, or of one partition or the default."""
    args = ["sinfo", "-h", "-N"] + (["-n", nodelist] if nodelist else []) + ["-o", "%N %t"]
    return call(args + (["-p", partition] if partition else []), env, timeout_s)


def partitions(env: Mapping[str, str] | None, timeout_s: float, extra_dirs: Iterable[Path] = ()) -> Answer:
    """`sinfo --noheader --format=%P|%D|%t`: partition, node count and state, one line per group."""
    return call(["sinfo", "--noheader", "--format=%P|%D|%t"], env, timeout_s, extra_dirs)


def node_names(env: Mapping[str, str] | None, timeout_s: float, extra_dirs: Iterable[Path] = ()) -> Answer:
    """`sinfo --noheader --Node --format=%N`: every node of the cluster, one a line."""
    return call(["sinfo", "--noheader", "--Node", "--format=%N"], env, timeout_s, extra_dirs)


def installed(env: Mapping[str, str], extra_dirs: Iterable[Path], *names: str) -> bool:
    """Whether all of these Slurm clients (SCONTROL, SINFO) are on PATH or in extra_dirs."""
    return all(program(name, env, extra_dirs) is not None for name in names)


def queue_json(args: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`squeue --json` with these filters."""
    return run(["squeue", "--json", *args], env=env, check=False)


def sacct(args: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S):
    """sacct with these arguments (its exit status left to the caller)."""
    return run(["sacct", *args], env=env, check=False, timeout_s=timeout_s)


def set_requeue(job_id: str, on: bool, timeout_s: float = 60) -> Answer:
    return call(["scontrol", "update", f"JobId={job_id}", f"Requeue={int(on)}"], timeout_s=timeout_s)


def requeue(job_id: str, timeout_s: float = 60) -> Answer:
    return call(["scontrol", "requeue", job_id], timeout_s=timeout_s)


def fail_node(node: str, reason: str, timeout_s: float = 60) -> Answer:
    """Set the node to fail with this reason (HyperPod's agent replaces a node failed with Action:Replace)."""
    return call(["scontrol", "update", f"node={node}", "state=fail", f"reason={reason}"], timeout_s=timeout_s)


def job_steps(job_id: str, timeout_s: float = 60, except_named: str = "") -> list[str]:
    """The job's steps as squeue names them (JOB.STEP, JOB.batch, JOB.extern), but those whose step name is
    `except_named`; [] when squeue does not answer."""
    done = call(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], timeout_s=timeout_s)
    if done.rc is None:
        return []
    steps = [line.split(None, 1) for line in done.out.splitlines() if line.strip()]
    return [words[0] for words in steps if not except_named or words[1:] != [except_named]]


def kill_step(step: str, timeout_s: float = 60) -> Answer:
    return call(["scancel", "--signal=KILL", step], timeout_s=timeout_s)
