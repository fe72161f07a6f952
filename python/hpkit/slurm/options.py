"""Slurm options a job spec may carry: the typed fields' syntax and the escape hatch's known options.

Values end up in `#SBATCH` lines, which sbatch reads itself (not a shell): it splits on whitespace,
strips quotes and backslashes and ends the line at an unquoted '#'. So every value here must be one
plain token; the checks below keep Slurm's own syntax where it is simple enough to state.
"""

from __future__ import annotations

import re

from hpkit.slurm.hostlist import HostlistError, expand

# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]], or no limit.
# re.ASCII throughout: \d would also take other scripts' digits ("٣٠"), which int() reads and Slurm does not.
SLURM_TIME = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}(:\d{1,2})?)?|UNLIMITED|INFINITE)$", re.ASCII
)
SLURM_TIME_FORMS = "use minutes, HH:MM:SS, D-HH:MM:SS or UNLIMITED (at most 4294967293 minutes)"

# The most nodes a job may ask for: more than any Slurm cluster holds (a million GPUs is 125,000 nodes of 8), and few
# enough that the planner's layout search over a world's divisors stays in seconds (99999999999999999999 ran for hours).
MAX_NODES = 1_000_000
# Slurm keeps a node's task, CPU-per-task and GPU counts in 16 bits, and slurm.conf's MaxTasksPerNode "may not
# exceed 65533": past it sbatch refuses the script (or the planner searches a world of 10^20 ranks).
MAX_PER_NODE = 65_533


# Slurm keeps a time limit in 32-bit minutes, 0xfffffffe and 0xffffffff being "unset" and INFINITE.
MAX_TIME_MINUTES = 0xFFFFFFFD


def is_slurm_time(value: str) -> bool:
    """Slurm's time syntax, within what Slurm can hold (UNLIMITED and INFINITE always)."""
    if SLURM_TIME.match(value) is None:
        return False
    return value in ("UNLIMITED", "INFINITE") or time_minutes(value) <= MAX_TIME_MINUTES


def time_minutes(value: str) -> int:
    """The minutes of a time in Slurm's syntax (SLURM_TIME; not UNLIMITED), seconds rounded up as Slurm does:
    M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        hours, minutes, seconds = [*parts, 0, 0][:3]
        return ((int(days) * 24 + hours) * 60 + minutes) + (1 if seconds else 0)
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + (1 if parts[2] else 0)
    return parts[0] + (1 if len(parts) == 2 and parts[1] else 0)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# sbatch's long options in Slurm 22.05: the union of `sbatch --help` and sbatch(1) on Debian 12's
# slurm-client 22.05 (tests/unit/test_slurm_options.py re-reads both where they are installed).
SBATCH_OPTIONS = _names(
    """
    account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint
    container contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline
    delay-boot dependency distribution error exclude exclusive export export-file extra-node-info
    get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags
    help hint hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label
    mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile nodelist nodes
    ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode output overcommit
    oversubscribe parsable partition power prefer priority profile propagate qos quiet reboot requeue
    reservation signal sockets-per-node spread-job switches test-only thread-spec threads-per-core time
    time-min tmp uid usage use-min-nodes verbose version wait wait-all-nodes wckey wrap
    """
)
# srun's long options in Slurm 22.05, gathered the same way.
SRUN_OPTIONS = _names(
    """
    accel-bind account acctg-freq bb bbf bcast bcast-exclude begin chdir cluster-constraint clusters
    comment compress constraint container contiguous core-spec cores-per-socket cpu-bind cpu-freq
    cpus-per-gpu cpus-per-task deadline delay-boot dependency disable-status distribution epilog error
    exact exclude exclusive export extra-node-info gid gpu-bind gpu-freq gpus gpus-per-node
    gpus-per-socket gpus-per-task gres gres-flags help het-group hint hold immediate input job-name jobid
    kill-on-bad-exit label licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu
    mincpus mpi msg-timeout multi-prog network nice no-allocate no-kill nodefile nodelist nodes
    ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode output overcommit
    overlap oversubscribe partition power prefer preserve-env priority profile prolog propagate pty qos
    quiet quit-on-interrupt reboot relative reservation resv-ports send-libs signal slurmd-debug
    sockets-per-node spread-job switches task-epilog task-prolog test-only thread-spec threads
    threads-per-core time time-min tmp uid unbuffered usage use-min-nodes verbose version wait wckey x11
    """
)
# What 24.11 (HyperPod's Slurm) adds to each (its `sbatch --help`/`srun --help`, tests/fixtures/slurm-24.11); none
# of 22.05's went away. Known to hpkit on every version: on 22.05, sbatch itself says it does not know them.
SBATCH_OPTIONS_SINCE_24_11 = _names("container-id oom-kill-step resv-ports tres-bind tres-per-task")
SRUN_OPTIONS_SINCE_24_11 = _names("container-id oom-kill-step tres-bind tres-per-task")
SBATCH_OPTIONS = SBATCH_OPTIONS | SBATCH_OPTIONS_SINCE_24_11
SRUN_OPTIONS = SRUN_OPTIONS | SRUN_OPTIONS_SINCE_24_11
# pyxis (the SPANK plugin HyperPod uses for containers) adds these to srun where it is installed.
PYXIS_OPTIONS = _names(
    """
    container-image container-mounts container-workdir container-name container-save
    container-mount-home no-container-mount-home container-remap-root no-container-remap-root
    container-entrypoint no-container-entrypoint container-entrypoint-log container-writable
    container-readonly container-env
    """
)

# Options hpkit writes itself, or that a typed field carries: the fix is to use that field.
_SPEC_FIELD = {
    "job-name": "name",
    "nodes": "nodes",
    "ntasks": "nodes and tasks_per_node",
    "ntasks-per-node": "tasks_per_node (or gpus_per_node)",
    "cpus-per-task": "cpus_per_task",
    "gpus-per-node": "gpus_per_node",
    "gpus": "gpus_per_node",
    "output": "output_dir",
    "error": "output_dir (hpkit keeps stdout and stderr in one log, which `hpkit logs` reads)",
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "time": "time_limit",
    "chdir": "workdir",
    "exclusive": "exclusive",
    "open-mode": "nothing: hpkit appends so that a requeued job keeps its first run's log",
    "signal": "signal",
    "requeue": "resilience.max_restarts and resilience.requeue_on_failure",
    "no-requeue": "resilience.max_restarts and resilience.requeue_on_failure",
    # With it a lost node leaves the job running without its script (when it ran the batch script):
    # only a job that Slurm ends on a node failure can be requeued by it.
    "no-kill": "resilience.requeue_on_failure (Slurm requeues the job when a node fails)",
    "exclude": "exclude",
    "nodelist": "nodelist",
    "constraint": "constraint",
    "mem": "mem",
    "gres": "gres",
    "reservation": "reservation",
    "dependency": "dependency",
    "mail-type": "mail_type",
    "mail-user": "mail_user",
}
SBATCH_SET_BY_HPKIT = {
    **_SPEC_FIELD,
    # Slurm 24.11 refuses --tres-per-task=cpu: beside the --cpus-per-task that hpkit writes ("You can not have
    # --tres-per-task=cpu= and --cpus-per-task"); 22.05 has no such option.
    "tres-per-task": "cpus_per_task (and gpus_per_node for GPUs)",
}
SRUN_SET_BY_HPKIT = {
    **{k: v for k, v in _SPEC_FIELD.items() if k in ("job-name", "nodes", "ntasks", "ntasks-per-node")},
    **{k: v for k, v in _SPEC_FIELD.items() if k in ("cpus-per-task", "gpus-per-node", "gpus")},
    "output": "output_dir (the steps write into the job's log, which `hpkit logs` reads)",
    "error": "output_dir (the steps write into the job's log, which `hpkit logs` reads)",
    "kill-on-bad-exit": "nothing: hpkit sets it so that one failed rank ends the step",
    "mpi": "launcher: mpi",
    "multi-prog": "command",
    "container-image": "container.image",
    "container-mounts": "container.mounts",
    "container-workdir": "container.workdir",
}
# Options that would replace the script or change how sbatch/srun answer hpkit, not the job.
_NOT_JOB_OPTIONS = {
    "wrap": "it replaces the rendered script",
    "help": "it prints help instead of submitting",
    "usage": "it prints help instead of submitting",
    "version": "it prints a version instead of submitting",
    "parsable": "hpkit reads sbatch's answer itself",
    "quiet": "hpkit reads sbatch's answer itself",
    "wait": "use `hpkit submit --wait`",
    "test-only": "use `hpkit submit --dry-run`",
    "array": "a sweep is hpkit's job array: `hpkit submit SPEC --sweep KEY=A,B` (--max-parallel N for %N)",
    "pty": "the step runs in a batch job, without a terminal",
    "jobid": "the step runs inside the job hpkit submitted",
    "no-allocate": "the step runs inside the job hpkit submitted",
}

# One token as sbatch's directive parser reads it: no whitespace, quotes, backslashes or '#'.
_TOKEN = re.compile(r"^[^\s\"'#\\\x00-\x1f\x7f]+$")
_HOSTLIST = re.compile(r"^[A-Za-z0-9._\-\[\],]+$")
_FEATURES = re.compile(r"^[A-Za-z0-9._\-&|,*\[\]()!:]+$")
_MEM = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE | re.ASCII)
_GRES_ITEM = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*(:[A-Za-z0-9_.\-]+)?(:\d+)?$", re.ASCII)
_JOB = r"\d+(?:_\d+)?"
_DEP_ITEM = (
    rf"(?:singleton|after(?::{_JOB}(?:\+\d+)?)+"
    rf"|(?:afterany|afterburstbuffer|aftercorr|afternotok|afterok)(?::{_JOB})+)"
)
_DEPENDENCY = re.compile(rf"^{_DEP_ITEM}(?:(?:,{_DEP_ITEM})*|(?:\?{_DEP_ITEM})*)$", re.ASCII)
MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)
_MAIL_USER = re.compile(r"^[A-Za-z0-9._%+\-]+(@[A-Za-z0-9.\-]+)?$")
# Names Slurm's sig_name2num knows (with or without SIG), or a number.
SIGNALS = (
    "HUP",
    "INT",
    "QUIT",
    "ABRT",
    "KILL",
    "ALRM",
    "TERM",
    "USR1",
    "USR2",
    "URG",
    "CONT",
    "STOP",
    "TSTP",
)
_SIGNAL = re.compile(r"^(?:([RB]):)?(?:SIG)?([A-Z0-9]+)(?:@(\d+))?$", re.IGNORECASE | re.ASCII)


def _token(value: str, what: str = "") -> str:
    """`what` prefixes the message where the field name alone does not say which value is meant."""
    if not value:
        raise ValueError(f"{what}the value is empty")
    if not _TOKEN.match(value):
        raise ValueError(
            f"{what}{value!r} must be one token: no whitespace, quotes, backslashes, '#' or control "
            "characters (sbatch reads #SBATCH lines unquoted)"
        )
    return value


def hostlist(value: str) -> str:
    _token(value)
    if not _HOSTLIST.match(value) or value.count("[") != value.count("]"):
        raise ValueError(f"{value!r} is not a Slurm host list such as node[1-4,7],gpu-12")
    try:  # ranges too: sbatch refuses n[3-1], and only at submission
        expand(value)
    except HostlistError as exc:
        raise ValueError(f"{exc} (a host list such as node[1-4,7],gpu-12)") from None
    return value


def constraint(value: str) -> str:
    _token(value)
    if not _FEATURES.match(value):
        raise ValueError(f"{value!r}: use node features joined by &, |, ',' with [], () and *N counts")
    return value


def mem(value: str) -> str:
    if not _MEM.match(value):
        raise ValueError(f"{value!r} is not a Slurm size: a number with an optional unit K, M, G or T (64G)")
    return value.upper()


def gres(value: str) -> str:
    _token(value)
    for item in value.split(","):
        if not _GRES_ITEM.match(item):
            raise ValueError(f"{item!r} is not of the form name[:type][:count] (gpu:a100:8, nvme:1)")
    return value


def dependency(value: str) -> str:
    _token(value)
    if not _DEPENDENCY.match(value):
        raise ValueError(
            f"{value!r} is not a Slurm dependency: type:jobid[:jobid] joined by ',' (all) or '?' (any), "
            "types after (jobid[+minutes]), afterany, afterok, afternotok, aftercorr, afterburstbuffer, "
            "or singleton"
        )
    return value


def mail_types(values: list[str]) -> list[str]:
    out = []
    for value in values:
        upper = str(value).strip().upper()
        if upper not in MAIL_TYPES:
            raise ValueError(f"{value!r} is not a Slurm mail type: use {', '.join(MAIL_TYPES)}")
        out.append(upper)
    return out


def mail_user(value: str) -> str:
    if not _MAIL_USER.match(value):
        raise ValueError(f"{value!r} is not a user name or mail address")
    return value


def signal(value: str) -> str:
    match = _SIGNAL.match(value)
    if not match:
        raise ValueError(f"{value!r} is not of the form [{{R|B}}:]<signal>[@seconds] (B:USR1@300)")
    prefix, sig, seconds = match.groups()
    if not (sig.isdigit() and 1 <= int(sig) <= 64) and sig.upper() not in SIGNALS:
        raise ValueError(f"{value!r}: signal {sig!r} is not a number 1-64 or one of {', '.join(SIGNALS)}")
    if seconds is not None and int(seconds) > 65535:
        raise ValueError(f"{value!r}: the time before the end must be 0-65535 seconds")
    # The batch shell traps USR1 only (to checkpoint and requeue); another signal would kill it.
    if prefix and "B" in prefix.upper() and sig.upper() not in ("USR1", "10"):
        raise ValueError(
            f"{value!r}: hpkit's batch script handles only USR1 (B:USR1@<seconds>); to send {sig} "
            "to the job's steps instead, leave out B:"
        )
    return value


def extra_option(entry: str, command: str) -> str:
    """One `--name[=value]` entry of sbatch_options/srun_options, refused with the reason and the fix."""
    known = SBATCH_OPTIONS if command == "sbatch" else SRUN_OPTIONS | PYXIS_OPTIONS
    owned = SBATCH_SET_BY_HPKIT if command == "sbatch" else SRUN_SET_BY_HPKIT
    if any(ord(c) < 32 or ord(c) == 127 for c in entry):
        raise ValueError(f"{entry!r}: an entry must not contain newlines or other control characters")
    if not entry.startswith("--"):
        raise ValueError(f"{entry!r}: give a long option, --name=value (short options are not accepted)")
    name, eq, value = entry[2:].partition("=")
    if name not in known:
        raise ValueError(
            f"{entry!r}: --{name} is not an {command} option hpkit knows (Slurm 22.05 and 24.11); "
            "spell it out in full, abbreviations are not accepted"
        )
    if name in owned:
        raise ValueError(f"{entry!r}: hpkit sets --{name} itself: use {owned[name]} in the spec instead")
    if name in _NOT_JOB_OPTIONS:
        raise ValueError(f"{entry!r}: --{name} is not accepted here: {_NOT_JOB_OPTIONS[name]}")
    if eq:
        _token(value, f"{entry!r}: the value ")
    return entry
