"""`hpkit render | submit | status | wait | logs | cancel`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from hpkit import arg_types
from hpkit.errors import HpkitError, SlurmError


def _parser(command: str, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    if command in ("render", "submit"):
        parser.add_argument("spec", help="job spec (YAML)")
    elif command == "wait":
        parser.add_argument(
            "job_ids",
            nargs="+",
            type=arg_types.job_id,
            metavar="job_id",
            help="Slurm job id(s) (JOB_TASK for a task of a job array; a sweep's array id: all its tasks): one "
            "poll serves all",
        )
    elif command == "status":
        parser.add_argument(
            "job_id",
            nargs="?",
            type=arg_types.job_id,
            help="Slurm job id, JOB_TASK for a task of a job array; a sweep's array id: a table of its tasks "
            "(default: a table of your jobs)",
        )
    else:
        parser.add_argument("job_id", type=arg_types.job_id, help="Slurm job id")
    if command == "render":
        parser.add_argument("-o", "--output", help="write the script here instead of printing it")
    if command == "submit":
        parser.add_argument("--dry-run", action="store_true", help="write the script, do not submit")
        parser.add_argument(
            "--sweep",
            action="append",
            default=[],
            metavar="KEY=V1,V2",
            help="submit one job array over these values of a training field (train.lr=1e-4,3e-4); several "
            "--sweep flags make a grid of every combination",
        )
        parser.add_argument(
            "--sweep-file",
            metavar="FILE",
            help="a sweep as YAML/JSON: a list of override mappings (one task each), or a mapping of keys to "
            "lists of values (a grid)",
        )
        parser.add_argument(
            "--max-parallel",
            type=int,
            metavar="K",
            help="a sweep's tasks that may run at once (#SBATCH --array=0-N%%K; default: all)",
        )
        parser.add_argument("--wait", action="store_true", help="wait for the job to end")
    if command in ("submit", "wait"):
        parser.add_argument(
            "--follow",
            action="store_true",
            help="submit: stream the job's output while waiting; wait: show the status line live "
            "(training progress for hpkit training jobs)",
        )
        parser.add_argument(
            "--timeout",
            type=arg_types.positive_float,
            default=None,
            help="give up waiting after this many seconds",
        )
        parser.add_argument(
            "--poll",
            type=arg_types.positive_float,
            default=1.0,
            help="seconds between the first polls (default 1; then 2, 5, 10 while no job changes state)",
        )
        parser.add_argument(
            "--outage-timeout",
            type=arg_types.positive_float,
            default=120.0,
            help="give up when Slurm has not answered for this many seconds (default 120)",
        )
    if command == "logs":
        parser.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    if command == "status":
        parser.add_argument("--json", action="store_true", help="print JSON")
    if command != "render":
        parser.add_argument("--backend", choices=["auto", "cli", "pyslurm"], default="auto")
    return parser


def parse_args(argv: list[str], prog: str = "hpkit") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(argv[0], prog).parse_args(argv[1:])


def main(argv: list[str], prog: str = "hpkit") -> int:
    command = argv[0]
    args = parse_args(argv, prog)
    return {
        "render": _render,
        "submit": _submit,
        "status": _status,
        "wait": _wait,
        "logs": _logs,
        "cancel": _cancel,
    }[command](args)


def _render(args: argparse.Namespace) -> int:
    from hpkit.jobs.submission import write_new
    from hpkit.render import render
    from hpkit.slurm.script import runtime_notes
    from hpkit.spec import JobSpec
    from hpkit.validation import load_document

    spec = load_document(JobSpec, args.spec)
    for note in runtime_notes(spec.job, warm=spec.warm_starts):
        print(f"hpkit render: note: {note}", file=sys.stderr)
    name = args.output or f"{spec.job.name}.sbatch"
    script = render(spec, script_name=name, spec_path=str(Path(args.spec).resolve()))
    if args.output:
        write_new(Path(args.output), script, mode=0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def _sweep_of(args: argparse.Namespace):
    """The sweep the flags ask for, or None; SpecError (one line) for a bad one."""
    from hpkit.errors import SpecError
    from hpkit.jobs.sweep import Sweep, grid, parse_axis, read_sweep_file

    if args.sweep and args.sweep_file:
        raise SpecError("--sweep and --sweep-file: give one of them (a sweep file can hold a grid)")
    if args.sweep:
        tasks = grid([parse_axis(text) for text in args.sweep])
    elif args.sweep_file:
        tasks = read_sweep_file(args.sweep_file)
    elif args.max_parallel is not None:
        raise SpecError("--max-parallel: applies to a sweep only: add --sweep KEY=V1,V2 or --sweep-file")
    else:
        return None
    return Sweep(tasks, args.max_parallel)


def _submit(args: argparse.Namespace) -> int:
    from hpkit.jobs.submission import give_job_path, prepare, submit
    from hpkit.slurm import get_backend
    from hpkit.slurm.script import runtime_notes

    submission = prepare(args.spec, _sweep_of(args))
    for note in runtime_notes(submission.spec.job):
        print(f"hpkit submit: note: {note}", file=sys.stderr)
    give_job_path(submission)
    if args.dry_run:
        print(f"dry run: wrote {submission.script}")
        return 0
    backend = get_backend(args.backend)
    job = submit(submission, backend)
    spec = submission.spec.job
    print(f"submitted job {job.job_id} ({spec.name}, {spec.nodes} node(s) x {spec.ranks_per_node} rank(s))")
    print(f"  script: {submission.script}")
    if submission.tasks:
        from hpkit.jobs.sweep import describe

        print(f"  job array: {len(submission.tasks)} task(s); `hpkit status {job.job_id}` shows them all")
        for task_id, task in zip(submission.task_ids(job.job_id), submission.tasks, strict=True):
            print(f"    {task_id}: {describe(task.overrides)}  output: {submission.log_file(task_id)}")
    else:
        print(f"  output: {submission.log_file(job.job_id)}")
    sys.stdout.flush()
    if job.note_problem:
        print(
            f"hpkit submit: note: {job.note_problem}; `hpkit status {job.job_id}` will lose track of the "
            "training files once Slurm forgets the job (set HPKIT_STATE_DIR to a writable directory)",
            file=sys.stderr,
        )
    if not args.wait:
        return 0
    return _wait_for(backend, submission.task_ids(job.job_id) or [job.job_id], args)


def _wait_for(backend, job_ids: list[str], args: argparse.Namespace) -> int:
    from hpkit.jobs.watch import exit_status, wait_for

    infos = wait_for(
        backend,
        job_ids,
        poll_s=args.poll,
        timeout_s=args.timeout,
        outage_limit_s=args.outage_timeout,
        show_log=args.follow,
    )
    return exit_status(infos)


def _wait(args: argparse.Namespace) -> int:
    from hpkit.jobs.files import array_tasks
    from hpkit.slurm import JobState, TransientSlurmError, get_backend, polled_fields

    backend = get_backend(args.backend)
    # A sweep's job array is waited for as all its tasks (Slurm's record of the array id is one task's). One
    # poll of every job tells which are arrays (their scripts), not one scontrol call per job.
    with contextlib.suppress(TransientSlurmError):  # the wait below rides out an outage
        backend.poll(args.job_ids)
    job_ids = [
        task_id
        for job_id in args.job_ids
        for task_id in (
            [t.task_id for t in array_tasks(job_id, polled=polled_fields(backend, job_id)) or []] or [job_id]
        )
    ]
    if not args.follow or len(job_ids) > 1:
        return _wait_for(backend, job_ids, args)
    # The status line, live: progress for a training job, Slurm's state for any other.
    from hpkit.jobs.watch import follow

    info = follow(
        backend,
        args.job_ids[0],
        poll_s=args.poll,
        timeout_s=args.timeout,
        outage_limit_s=args.outage_timeout,
    )
    return 0 if info.state == JobState.COMPLETED else info.exit_code or 1


def _status(args: argparse.Namespace) -> int:
    from hpkit.jobs.watch import JobWatcher, line, record
    from hpkit.slurm import get_backend

    if args.job_id is None:
        return _status_table(args)
    backend = get_backend(args.backend)
    # One poll (squeue) answers for the job and for whether it is a sweep's array: no scontrol after it.
    info, prog = JobWatcher(backend, args.job_id).poll()
    if _array_table(args, backend):
        return 0
    if args.json:
        print(json.dumps(record(info, prog), indent=2))
    else:
        print(line(info, prog))
    return 0


def _array_table(args: argparse.Namespace, backend) -> bool:
    """A sweep's job array: one row per task (overrides, state, final loss); False for any other job."""
    from hpkit.jobs.files import array_tasks
    from hpkit.jobs.sweep_status import format_rows, task_rows
    from hpkit.slurm import polled_fields

    tasks = array_tasks(args.job_id, polled=polled_fields(backend, args.job_id))
    if tasks is None:
        return False
    rows = task_rows(backend, tasks)
    print(json.dumps([r.to_json() for r in rows], indent=2) if args.json else format_rows(rows))
    return True


def _status_table(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hpkit.jobs.status_table import format_table
    from hpkit.slurm import CliBackend, user_jobs

    rows = user_jobs(CliBackend())
    if args.json:
        print(json.dumps([{**asdict(r), "state": r.state.value} for r in rows], indent=2))
    else:
        print(format_table(rows, now=time.time()))
    return 0


def _logs(args: argparse.Namespace) -> int:
    from hpkit.slurm import get_backend, wait

    backend = get_backend(args.backend)
    info = backend.info(args.job_id)
    if not info.stdout:
        raise SlurmError(f"job {args.job_id} has no output file on record")
    from hpkit.jobs.watch import LogFollower

    follower = LogFollower()
    if not args.follow:
        if not Path(info.stdout).is_file():
            raise HpkitError(f"{info.stdout} does not exist (yet): is the job still pending?")
        follower.pump(info)
        return 0
    follower.remember(info)
    if not info.ended:  # a preempted job that Slurm requeues writes more
        # The same polling as `hpkit wait` (one call per poll, backing off, riding out controller
        # restarts); the file is read every half second in between.
        info = wait(backend, args.job_id, on_poll=follower.remember, on_tick=follower.pump_last)
        time.sleep(0.3)
        follower.pump(info)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from hpkit.slurm import get_backend

    get_backend(args.backend).cancel(args.job_id)
    print(f"cancelled job {args.job_id}")
    return 0
