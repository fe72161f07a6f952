"""Submit a job spec from Python: check it, write its snapshot and script, hand them to sbatch.

`hpkit submit` is this plus printing; a user's own Python (a sweep, a notebook) calls `submit` the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from hpkit.errors import HpkitError, SpecError
from hpkit.job_events import task_name
from hpkit.jobs.index import JobNote, remember
from hpkit.jobs.sweep import Sweep, SweepTask, expand, sweep_manifest
from hpkit.oci import check_container
from hpkit.render import render
from hpkit.slurm import Backend, get_backend, slurm_version
from hpkit.slurm.job import SlurmJob, oci_launcher_problem, oci_warm_problem
from hpkit.slurm.script import ArrayPlan
from hpkit.spec import SNAPSHOT_HEADER, JobSpec
from hpkit.validation import load_document, read_document


@dataclass(frozen=True)
class Submission:
    """What `prepare` wrote: the validated spec, its snapshot, the sbatch script and the job's log folder;
    for a sweep, every task (its overrides and validated spec) and the sweep's manifest."""

    spec: JobSpec
    spec_copy: Path
    script: Path
    out_dir: Path
    tasks: tuple[SweepTask, ...] = ()
    manifest: Path | None = None

    def log_file(self, job_id: str) -> Path:
        """The log of a job, or of a job array's task `JOB_TASK`."""
        return self.out_dir / f"{self.spec.job.name}-{job_id}.out"

    def task_ids(self, job_id: str) -> list[str]:
        """Slurm's names for the tasks of the job array `job_id` (none for a single job)."""
        return [task_name(job_id, task.index) for task in self.tasks]


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    submission: Submission
    # Why the job could not be noted for `hpkit status` once Slurm forgets it; None when it was.
    note_problem: str | None = None


def write_new(path: Path, text: str, mode: int = 0o644) -> None:
    """Write through a temporary file and rename, so a reader never sees half a script."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(mode)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        reason = exc.strerror or str(exc)
        raise HpkitError(
            f"cannot write {path}: {reason}: choose a writable place (-o, or output_dir in the spec)"
        ) from None


def snapshot_text(spec: JobSpec) -> str:
    """The snapshot of a spec that travels with its job, as YAML: what `hpkit train --config` reads back on every
    rank, so it must load as the same spec (tests/unit/test_spec.py loads every shipped spec's back)."""
    # libyaml's emitter where PyYAML has it: the pure-Python one took 8 ms a snapshot, 80 s for a 10,000-task sweep.
    return SNAPSHOT_HEADER + yaml.dump(spec.document(), Dumper=_DUMPER, sort_keys=False)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def job_workdir(job: SlurmJob) -> Path:
    """Where the job will run (sbatch's --chdir, else the directory it is submitted from)."""
    return (Path(job.workdir) if job.workdir else Path.cwd()).resolve()


def prepare(spec_file: str | Path, sweep: Sweep | None = None) -> Submission:
    """Everything `hpkit submit` does before sbatch: check the spec, write its snapshot and the script.

    With `sweep`, every task's spec is checked first, and the script is one job array whose tasks each read
    their own snapshot. Nothing here depends on the node count (bench/bench_render_scale.py compares 2,048
    nodes with 2).
    """
    spec = load_document(JobSpec, spec_file)
    job = spec.job
    tasks = expand(read_document(spec_file), sweep, str(spec_file)) if sweep is not None else []
    # An OCI bundle or mount source that is not there would fail every node at job start: say so now.
    try:
        check_container(job.container)
    except SpecError as exc:
        raise SpecError(f"{spec_file}: {exc}") from None
    cluster_version = functools.cache(slurm_version)  # sinfo once, whichever checks ask
    for problem in (
        oci_launcher_problem(job, cluster_version),
        oci_warm_problem(job, spec.warm_starts, cluster_version),
    ):
        if problem:
            raise SpecError(f"{spec_file}: {problem}")
    out_dir = (job_workdir(job) / job.output_dir).resolve()
    # A snapshot of the spec travels with the job: editing the YAML after submitting must not
    # change a job that is still pending.
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    spec_copy = out_dir / f"{job.name}-{stamp}.yaml"
    script = out_dir / f"{job.name}-{stamp}.sbatch"
    write_new(spec_copy, snapshot_text(spec))
    if not tasks:
        write_new(script, render(spec, script_name=str(script), spec_path=str(spec_copy)), mode=0o755)
        return Submission(spec, spec_copy, script, out_dir)
    assert sweep is not None
    pattern = str(out_dir / f"{job.name}-{stamp}.task%a.yaml")
    manifest = out_dir / f"{job.name}-{stamp}.sweep.json"
    for task in tasks:
        dump = snapshot_text(task.spec)
        write_new(Path(pattern.replace("%a", str(task.index))), dump)
    write_new(manifest, sweep_manifest(tasks, pattern))
    array = ArrayPlan(
        tasks=len(tasks),
        max_parallel=sweep.max_parallel,
        spec_pattern=pattern,
        overrides=[json.dumps(task.overrides) for task in tasks],
        manifest=str(manifest),
    )
    write_new(
        script, render(spec, script_name=str(script), spec_path=str(spec_copy), array=array), mode=0o755
    )
    return Submission(spec, spec_copy, script, out_dir, tuple(tasks), manifest)


def give_job_path(submission: Submission) -> None:
    """sbatch exports this process's environment to the job: give it the launcher of the environment that
    submits it, and refuse here (HpkitError) rather than fail on every node. Specs that set env.PATH are left
    as they are, and so are container jobs, but for Slurm's OCI containers, whose batch script writes the
    job's bundle with this environment's hpkit (the tasks' programs are the image's)."""
    spec = submission.spec.job
    if "PATH" in spec.env or (spec.container is not None and spec.container.runtime != "oci"):
        return
    from hpkit.jobs.path import check_programs, job_path, required_programs

    os.environ["PATH"] = job_path(os.environ)
    if spec.container is not None:
        return
    check_programs(required_programs(spec.launcher, spec.command), os.environ["PATH"], job_workdir(spec))


def submit(submission: Submission, backend: Backend | str = "auto") -> SubmittedJob:
    """sbatch the prepared script; note where its files are for `hpkit status` after Slurm forgets it."""
    give_job_path(submission)
    backend = get_backend(backend) if isinstance(backend, str) else backend
    job_id = backend.submit(submission.script)
    problem = remember(
        JobNote(
            job_id, submission.spec.job.name, str(submission.script), str(job_workdir(submission.spec.job))
        )
    )
    return SubmittedJob(job_id, submission, problem)
