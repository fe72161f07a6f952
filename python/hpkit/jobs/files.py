"""Where a Slurm job's hpkit files are: its spec snapshot, metrics JSONL and checkpoint directory.

Nothing extra is recorded for this: the controller knows the job's batch script (Command) and working
directory (WorkDir), the script rendered by hpkit exports HPKIT_SPEC (the spec snapshot `hpkit submit`
wrote), and the spec names output_dir, train.metrics_file and checkpoint.dir exactly as `hpkit train`
resolves them inside the job (relative paths from the job's working directory, %j the job id).
Paths with spaces survive: `scontrol show job -o` values are split on the next `Key=`, and the
script's export is one shell word, read back with shlex.

The controller forgets a job MinJobAge seconds after it ends; after that the note `hpkit submit` left
(hpkit.jobs.index) says where the script and working directory were.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpkit.errors import HpkitError
from hpkit.job_events import task_name
from hpkit.jobs.index import recall
from hpkit.runtime.run_identity import RunIdentity, run_paths
from hpkit.slurm import job_record

SPEC_EXPORT = "export HPKIT_SPEC="
SWEEP_EXPORT = "export HPKIT_SWEEP="
# In a job array's script, each task's spec snapshot is named by its number (hpkit.slurm.script.ARRAY_TASK_SHELL).
TASK_VARIABLE = "$SLURM_ARRAY_TASK_ID"


def split_task(job_id: str) -> tuple[str, str | None]:
    """`1234_5` -> ("1234", "5"), a task of a job array; `1234` -> ("1234", None)."""
    array, sep, task = job_id.partition("_")
    return (array, task) if sep else (job_id, None)


@dataclass(frozen=True)
class JobFiles:
    job_id: str
    spec_path: Path
    metrics_path: Path
    checkpoint_dir: Path | None
    total_steps: int
    slurm_restarts: int


@dataclass(frozen=True)
class ControllerRecord:
    script: Path | None
    workdir: Path | None
    restarts: int


def controller_record(
    job_id: str, env: Mapping[str, str] | None = None, fields: Mapping[str, str] | None = None
) -> ControllerRecord | None:
    """From `fields` (the controller's record in scontrol's words) when given, else from scontrol."""
    fields = job_record(job_id, env) if fields is None else fields
    if fields is None:
        return None
    restarts = fields.get("Restarts", "0")
    command = fields.get("Command", "")
    workdir = fields.get("WorkDir", "")
    return ControllerRecord(
        script=Path(command) if command.startswith("/") else None,
        workdir=Path(workdir) if workdir.startswith("/") else None,
        restarts=int(restarts) if restarts.isdigit() else 0,
    )


def _noted(job_id: str, name: str | None) -> ControllerRecord | None:
    note = recall(split_task(job_id)[0], name)  # the note is the whole array's
    if note is None:
        return None
    return ControllerRecord(script=Path(note.script), workdir=Path(note.workdir), restarts=0)


def _export(script: Path, export: str) -> str | None:
    """The value the script exports on its `export NAME=` line (hpkit's template writes it as one shell word)."""
    try:
        text = script.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(export):
            try:
                words = shlex.split(line[len("export ") :])
            except ValueError:
                return None
            if len(words) == 1:
                return words[0].split("=", 1)[1]
    return None


def spec_of_script(script: Path, task: str | None = None) -> Path | None:
    """The HPKIT_SPEC the script exports; in a job array's script, task `task`'s (None without a task)."""
    value = _export(script, SPEC_EXPORT)
    if value is None:
        return None
    if TASK_VARIABLE in value:
        return Path(value.replace(TASK_VARIABLE, task)) if task is not None else None
    return Path(value)


def sweep_of_script(script: Path) -> Path | None:
    """The sweep's manifest a job array's script exports (HPKIT_SWEEP, hpkit.jobs.sweep), else None."""
    value = _export(script, SWEEP_EXPORT)
    return Path(value) if value else None


def files_for(job_id: str, spec_path: Path, workdir: Path, slurm_restarts: int = 0) -> JobFiles | None:
    """The files `hpkit train` writes for this spec in this job; None when the spec is not a training job."""
    from hpkit.spec import load_parts

    try:
        job, cfg = load_parts(spec_path)
    except (HpkitError, OSError):
        return None
    command = job.command if job is not None else ["hpkit", "train"]
    if "train" not in command or not any(Path(word).name.startswith(("hpkit", "python")) for word in command):
        return None
    paths = run_paths(cfg, RunIdentity.of_job(job_id), workdir)
    return JobFiles(
        job_id, spec_path, paths.metrics_file, paths.checkpoint_dir, cfg.train.steps, slurm_restarts
    )


def locate(
    job_id: str,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    polled: tuple[bool, Mapping[str, str] | None] = (False, None),
) -> JobFiles | None:
    """The job's training files, or None for a job that is not an hpkit training job (or is forgotten).

    The controller's record first; once it has forgotten the job, the note `hpkit submit` left (for a job
    named `name`, where the caller knows Slurm's name for it). `polled` (hpkit.slurm.polled_fields): what
    the caller's own poll just had from the controller, so that scontrol is not asked again."""
    asked, fields = polled
    if asked:  # None: the poll found the controller had forgotten the job
        record = controller_record(job_id, env, fields) if fields is not None else None
    else:
        record = controller_record(job_id, env)
    record = record or _noted(job_id, name)
    if record is None or record.script is None or record.workdir is None:
        return None
    spec = spec_of_script(record.script, split_task(job_id)[1])
    if spec is None:
        return None
    return files_for(job_id, spec, record.workdir, record.restarts)


@dataclass(frozen=True)
class ArrayTask:
    task_id: str  # JOB_TASK
    overrides: dict
    files: JobFiles | None


def array_tasks(
    job_id: str,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    polled: tuple[bool, Mapping[str, str] | None] = (False, None),
) -> list[ArrayTask] | None:
    """The tasks of the sweep `job_id` (hpkit submit --sweep), each with its files; None for any other job.
    `polled` as for `locate`: the caller's own poll, so that scontrol is not asked again."""
    from hpkit.jobs.sweep import read_manifest

    if not job_id.isdigit():
        return None
    asked, fields = polled
    try:
        if asked:
            record = controller_record(job_id, env, fields) if fields is not None else None
        else:
            record = controller_record(job_id, env)
    except HpkitError:  # no Slurm client here: the note may still know the job
        record = None
    record = record or _noted(job_id, name)
    if record is None or record.script is None or record.workdir is None:
        return None
    manifest = sweep_of_script(record.script)
    tasks = read_manifest(str(manifest)) if manifest is not None else None
    if tasks is None:
        return None
    out = []
    for task in tasks:
        task_id = task_name(job_id, task.index)
        out.append(ArrayTask(task_id, task.overrides, files_for(task_id, Path(task.spec), record.workdir)))
    return out
