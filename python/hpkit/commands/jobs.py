"""`hpkit render | submit | status | wait | logs | cancel`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hpkit.errors import HpkitError, SlurmError


def _parser(command: str, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    if command in ("render", "submit"):
        parser.add_argument("spec", help="job spec (YAML)")
    elif command == "wait":
        parser.add_argument(
            "job_ids", nargs="+", metavar="job_id", help="Slurm job id(s): one poll serves all"
        )
    elif command == "status":
        parser.add_argument("job_id", nargs="?", help="Slurm job id (default: a table of your jobs)")
    else:
        parser.add_argument("job_id", help="Slurm job id")
    if command == "render":
        parser.add_argument("-o", "--output", help="write the script here instead of printing it")
    if command == "submit":
        parser.add_argument("--dry-run", action="store_true", help="write the script, do not submit")
        parser.add_argument("--wait", action="store_true", help="wait for the job to end")
    if command in ("submit", "wait"):
        parser.add_argument(
            "--follow",
            action="store_true",
            help="submit: stream the job's output while waiting; wait: show the status line live "
            "(training progress for hpkit training jobs)",
        )
        parser.add_argument(
            "--timeout", type=float, default=None, help="give up waiting after this many seconds"
        )
        parser.add_argument(
            "--poll",
            type=float,
            default=1.0,
            help="seconds between the first polls (default 1; then 2, 5, 10 while no job changes state)",
        )
        parser.add_argument(
            "--outage-timeout",
            type=float,
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


def main(argv: list[str], prog: str = "hpkit") -> int:
    command, rest = argv[0], argv[1:]
    args = _parser(command, prog).parse_args(rest)
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
    from hpkit.render import render, runtime_notes
    from hpkit.spec import JobSpec
    from hpkit.validation import load_document

    spec = load_document(JobSpec, args.spec)
    for note in runtime_notes(spec):
        print(f"hpkit render: note: {note}", file=sys.stderr)
    name = args.output or f"{spec.name}.sbatch"
    script = render(spec, script_name=name, spec_path=str(Path(args.spec).resolve()))
    if args.output:
        write_new(Path(args.output), script, mode=0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def _submit(args: argparse.Namespace) -> int:
    from hpkit.jobs.submission import give_job_path, prepare, submit
    from hpkit.render import runtime_notes
    from hpkit.slurm import get_backend

    submission = prepare(args.spec)
    for note in runtime_notes(submission.spec):
        print(f"hpkit submit: note: {note}", file=sys.stderr)
    give_job_path(submission)
    if args.dry_run:
        print(f"dry run: wrote {submission.script}")
        return 0
    backend = get_backend(args.backend)
    job = submit(submission, backend)
    spec = submission.spec
    print(f"submitted job {job.job_id} ({spec.name}, {spec.nodes} node(s) x {spec.ranks_per_node} rank(s))")
    print(f"  script: {submission.script}")
    print(f"  output: {submission.log_file(job.job_id)}", flush=True)
    if job.note_problem:
        print(
            f"hpkit submit: note: {job.note_problem}; `hpkit status {job.job_id}` will lose track of the "
            "training files once Slurm forgets the job (set HPKIT_STATE_DIR to a writable directory)",
            file=sys.stderr,
        )
    if not args.wait:
        return 0
    return _wait_for(backend, [job.job_id], args)


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
    from hpkit.slurm import JobState, get_backend

    backend = get_backend(args.backend)
    if not args.follow or len(args.job_ids) > 1:
        return _wait_for(backend, list(args.job_ids), args)
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
    info, prog = JobWatcher(get_backend(args.backend), args.job_id).poll()
    if args.json:
        print(json.dumps(record(info, prog), indent=2))
    else:
        print(line(info, prog))
    return 0


def _status_table(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hpkit.slurm import CliBackend, user_jobs
    from hpkit.status_table import format_table

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
    if not args.follow:
        try:
            sys.stdout.write(Path(info.stdout).read_text(encoding="utf-8", errors="replace"))
        except FileNotFoundError:
            raise HpkitError(f"{info.stdout} does not exist (yet): is the job still pending?") from None
        return 0
    from hpkit.jobs.watch import LogFollower

    follower = LogFollower()
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
