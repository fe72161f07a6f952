"""What `hpkit why` reads, and from where: the I/O half (hpkit.jobs.why_scan parses, hpkit.jobs.why decides).

In order: Slurm's record (`scontrol show job` while slurmctld remembers the job; the job-completion log when
JobCompType=jobcomp/filetxt; sacct where accounting is kept), the note `hpkit submit` left (hpkit.jobs.index),
the job's script (the controller's Command, else the note's), its output file(s) (StdOut/StdErr, else the
script's --output/--error, else slurm-JOBID.out in its working directory), hpkit's files beside them (the
supervisor's events file and runs file, hpkit.job_events; the hang watchdog's verdict.json folders; the
metrics file), and the slurmctld and slurmd logs
where this machine can read them. Whatever cannot be read is named in the verdict, not an error; only a
job that nothing knows is one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from hpkit.arg_types import job_id_problem
from hpkit.errors import HpkitError, SlurmError
from hpkit.job_events import events_path, hangs_dir, runs_path, verdict_paths, verdict_restart
from hpkit.jobs.files import files_for, spec_of_script, split_task
from hpkit.jobs.index import recall
from hpkit.jobs.why import Facts, Finding, SlurmRecord, Verdict, decide
from hpkit.jobs.why_scan import (
    JobEvents,
    scan_accounting,
    scan_events,
    scan_hang_verdict,
    scan_jobcomp,
    scan_metrics,
    scan_output,
    scan_runs_file,
    scan_scontrol,
    scan_slurm_log,
)
from hpkit.slurm import accounting, client, expand_output_pattern, hostlist
from hpkit.slurm.client import CLI_TIMEOUT_S


def explain(job_id: str, env: Mapping[str, str] | None = None) -> Verdict:
    """The verdict for a job: `gather` then `decide`."""
    return decide(gather(job_id, env))


class _Reader:
    def __init__(self, env: Mapping[str, str] | None):
        self.env = dict(env) if env is not None else None
        self.unreadable: list[str] = []

    def command(self, answer: client.Answer) -> tuple[int, str, str] | None:
        """(exit status, stdout, stderr), or None, noted, when the program is missing or does not answer."""
        if answer.missing:
            self.unreadable.append(f"{answer.args[0]}: not found here (no Slurm client on PATH)")
            return None
        if answer.timed_out:
            self.unreadable.append(f"{answer.command}: no answer in {CLI_TIMEOUT_S} s")
            return None
        if answer.rc is None:
            self.unreadable.append(f"{answer.command}: {answer.os_error}")
            return None
        return answer.rc, answer.out, answer.err

    def lines(self, path: Path, what: str) -> Iterator[str] | None:
        """The file's lines as they are read (logs can be large), or None, noted, when it cannot be read."""
        try:
            handle = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed by the generator)
        except OSError as exc:
            self.unreadable.append(f"{what} {path}: {exc.strerror or exc}")
            return None

        def read() -> Iterator[str]:
            with handle:
                while line := handle.readline(MAX_LINE_CHARS):
                    yield line
                    # The rest of an overlong line (a log of binary garbage, a progress bar without newlines) is
                    # skipped: each line is at most MAX_LINE_CHARS in memory, and what why looks for starts a line.
                    while len(line) == MAX_LINE_CHARS and not line.endswith("\n"):
                        line = handle.readline(MAX_LINE_CHARS)

        return read()

    def text(self, path: Path, what: str) -> str | None:
        lines = self.lines(path, what)
        return None if lines is None else "".join(lines)


# The most of one line `why` holds: a GB-sized output without a newline was read whole, as one line. Far past any
# line hpkit writes (an events line naming 16,000 nodes is about 200 KB).
MAX_LINE_CHARS = 1 << 24


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def gather(job_id: str, env: Mapping[str, str] | None = None) -> Facts:
    """Everything readable about the job. Raises HpkitError for a malformed id or a job nothing knows."""
    job_id = job_id.strip()
    problem = job_id_problem(job_id)
    if problem is not None:
        raise HpkitError(problem)
    read = _Reader(env)
    records: list[SlurmRecord] = []
    findings: list[Finding] = []
    controller: dict[str, str] = {}

    shown = read.command(client.show_job(job_id, read.env))
    if shown is not None:
        status, out, err = shown
        if status == 0 and out.strip():
            record, controller = scan_scontrol(out, f"scontrol show job {job_id}")
            records.append(record)
        elif "Invalid job id" in err:
            read.unreadable.append(
                f"scontrol show job {job_id}: slurmctld no longer remembers the job (it forgets ended jobs after MinJobAge)"
            )
        else:
            read.unreadable.append(f"scontrol show job {job_id}: {_last_line(err) or f'exit {status}'}")
    config = _config(read)

    jobcomp = _jobcomp(read, config, job_id)
    if jobcomp:
        records.append(jobcomp[-1])
    sacct_record, sacct_findings = _sacct(read, job_id)
    if sacct_record is not None:
        records.append(sacct_record)
    findings += sacct_findings

    name = next((r.name for r in records if r.name), None)
    note = recall(split_task(job_id)[0], name)  # a job array's note is the whole array's
    if not records and note is None:
        raise HpkitError(
            f"job {job_id} is unknown: slurmctld does not remember it, no job-completion log or sacct has it, "
            "and hpkit submit left no note of it" + _why_not(read.unreadable)
        )
    script = _path(controller.get("Command")) or (Path(note.script) if note else None)
    workdir = (
        _path(controller.get("WorkDir"))
        or (Path(note.workdir) if note else None)
        or next((_path(r.workdir) for r in records if _path(r.workdir)), None)
    )
    script_text = read.text(script, "job script") if script is not None else None
    if script is None:
        read.unreadable.append("job script: none on record (slurmctld names none, hpkit submit left no note)")
    job_name = name or (note.name if note else "")

    outputs = _outputs(controller, script_text, workdir, job_id, job_name)
    if not outputs:
        read.unreadable.append("job output: no output file on record")
    events = _events(read, job_id, outputs)
    for output in outputs:
        lines = read.lines(output, "job output")
        if lines is not None:
            findings += scan_output(lines, str(output), _start_line(output, events))
    if events is not None:
        findings += events.findings

    restarts = next((r.restarts for r in records if r.restarts is not None), None)
    findings += _hpkit_files(read, job_id, script, workdir, outputs, events, restarts)
    nodes = next((r.nodes for r in records if r.nodes and r.nodes not in ("(null)", "None assigned")), "")
    findings += _slurm_logs(read, config, job_id, nodes)
    torchrun = None if events is None or events.launcher is None else events.launcher == "torchrun"
    return Facts(job_id, records, findings, list(dict.fromkeys(read.unreadable)), torchrun)


def _events(read: _Reader, job_id: str, outputs: list[Path]) -> JobEvents | None:
    """The supervisor's events file, beside the job's log (None for a job that has none: not hpkit's)."""
    for folder in dict.fromkeys(o.parent for o in outputs):
        path = events_path(folder, job_id)
        if path.exists():
            lines = read.lines(path, "events file")
            return scan_events(lines, str(path)) if lines is not None else None
    return None


def _start_line(output: Path, events: JobEvents | None) -> int:
    """The line of `output` where the last step started: the first after the size the events recorded."""
    if events is None:
        return 1
    size = events.logs.get(os.path.realpath(output))
    if not size:
        return 1
    # Counted as `lines` reads: universal newlines (a lone "\r", as progress bars print, ends a line too) and an
    # overlong line as one. Counting "\n"-lines alone started the scan early in a log with "\r"s, in the step before.
    seen, number = 0, 1
    try:
        with open(output, "rb") as handle:
            while seen < size and (raw := handle.readline(MAX_LINE_CHARS)):
                seen += len(raw)
                number += raw.count(b"\r") - raw.endswith(b"\r\n") + raw.endswith(b"\n")
    except OSError:
        return 1
    return number if seen >= size else 1


def _why_not(unreadable: list[str]) -> str:
    return f" ({'; '.join(unreadable)})" if unreadable else ""


def _path(value: str | None) -> Path | None:
    return Path(value) if value and value.startswith("/") else None


def _config(read: _Reader) -> dict[str, str]:
    shown = read.command(client.show_config(read.env))
    if shown is None or shown[0] != 0:
        if shown is not None:
            read.unreadable.append(f"scontrol show config: {_last_line(shown[2]) or f'exit {shown[0]}'}")
        return {}
    config = {}
    for line in shown[1].splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip()
    return config


def _jobcomp(read: _Reader, config: Mapping[str, str], job_id: str) -> list[SlurmRecord]:
    kind, location = config.get("JobCompType", ""), config.get("JobCompLoc", "")
    if not config:
        return []
    if kind != "jobcomp/filetxt" or not location.startswith("/"):
        read.unreadable.append(
            f"job-completion log: JobCompType={kind or 'none'} is not a text file hpkit reads"
        )
        return []
    lines = read.lines(Path(location), "job-completion log")
    return [] if lines is None else scan_jobcomp(lines, location, job_id)


def _sacct(read: _Reader, job_id: str) -> tuple[SlurmRecord | None, list[Finding]]:
    """Accounting's record (hpkit.slurm.accounting: sacct --json, every run of a requeued job)."""
    try:
        found = accounting([job_id], read.env, CLI_TIMEOUT_S).get(job_id)
    except SlurmError as exc:  # AccountingUnavailable included: "sacct: Slurm accounting storage is disabled"
        read.unreadable.append(f"sacct: {exc}")
        return None, []
    if found is None:
        read.unreadable.append(f"sacct: no record of job {job_id}")
        return None, []
    return scan_accounting(found, f"sacct --json -D -j {job_id}")


def _outputs(
    controller: Mapping[str, str], script: str | None, workdir: Path | None, job_id: str, name: str
) -> list[Path]:
    paths = [p for p in (_path(controller.get("StdOut")), _path(controller.get("StdErr"))) if p]
    if not paths and script is not None:
        values = {"job_id": job_id, "name": name, "current_working_directory": str(workdir or ".")}
        array, task = split_task(job_id)
        if task is not None:  # a task of a job array: its log is named by %A_%a
            values.update(array_job_id=array, array_task_id=task)
        for option in ("output", "error"):
            pattern = _sbatch_option(script, option)
            path = expand_output_pattern(pattern, values) if pattern else None
            if path:
                paths.append(Path(path))
    if not paths and workdir is not None:
        paths.append(workdir / f"slurm-{job_id}.out")  # sbatch's default
    return list(dict.fromkeys(paths))


def _sbatch_option(script: str, option: str) -> str | None:
    short = {"output": "o", "error": "e"}[option]
    for line in script.splitlines():
        match = re.match(rf"#SBATCH\s+(?:--{option}[= ]|-{short}\s*)(\S+)", line)
        if match:
            return match.group(1).strip("'\"")
    return None


def _hpkit_files(
    read: _Reader,
    job_id: str,
    script: Path | None,
    workdir: Path | None,
    outputs: list[Path],
    events: JobEvents | None,
    restarts: int | None,
) -> list[Finding]:
    found: list[Finding] = []
    # The hang watchdog's folder: the events name it; else the one beside the log (`<output_dir>/hangs`).
    hangs = Path(events.hangs_dir) if events is not None and events.hangs_dir else None
    hangs = hangs or (hangs_dir(outputs[0].parent) if outputs else None)
    if hangs is not None:
        for path in verdict_paths(hangs, job_id):
            text = read.text(path, "hang verdict")
            finding = scan_hang_verdict(text, str(path), verdict_restart(path)) if text else None
            if finding is not None:
                found.append(finding)
    for folder in dict.fromkeys(o.parent for o in outputs):
        path = runs_path(folder, job_id)
        if path.exists():
            lines = read.lines(path, "runs file")
            found += scan_runs_file(lines, str(path)) if lines is not None else []
            break
    spec = spec_of_script(script, split_task(job_id)[1]) if script is not None else None
    files = (
        files_for(job_id, spec, workdir, restarts or 0) if spec is not None and workdir is not None else None
    )
    if files is not None and files.metrics_path.exists():
        lines = read.lines(files.metrics_path, "metrics file")
        found += scan_metrics(lines, str(files.metrics_path)) if lines is not None else []
    return found


def _slurm_logs(read: _Reader, config: Mapping[str, str], job_id: str, nodes: str) -> list[Finding]:
    if not config:
        return []
    found: list[Finding] = []
    ctld = config.get("SlurmctldLogFile", "")
    if ctld.startswith("/"):
        lines = read.lines(Path(ctld), "slurmctld log")
        found += scan_slurm_log(lines, ctld, job_id) if lines is not None else []
    else:
        read.unreadable.append("slurmctld log: SlurmctldLogFile is not set (syslog)")
    slurmd = config.get("SlurmdLogFile", "")
    if not slurmd.startswith("/"):
        read.unreadable.append("slurmd logs: SlurmdLogFile is not set (syslog)")
        return found
    if "%n" not in slurmd and "%h" not in slurmd:
        # One name for every node's log: the file here is this host's, which names no node of the job.
        lines = read.lines(Path(slurmd), "slurmd log")
        return found + (scan_slurm_log(lines, slurmd, job_id) if lines is not None else [])
    for node in _hostnames(nodes):
        path = Path(slurmd.replace("%n", node).replace("%h", node))
        lines = read.lines(path, f"slurmd log of {node}")
        if lines is not None:
            found += scan_slurm_log(lines, str(path), job_id, node)
    return found


def _hostnames(nodes: str) -> list[str]:
    try:
        return hostlist.expand(nodes)
    except hostlist.HostlistError:
        return []
