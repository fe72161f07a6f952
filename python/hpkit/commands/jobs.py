"""`hpkit render | submit | status | wait | logs | cancel`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from hpkit.errors import HpkitError, SlurmError

if TYPE_CHECKING:
    from hpkit.spec import JobSpec


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
            help="seconds between the first polls (default 1; then 2, 5, 10)",
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
    from hpkit.render import render
    from hpkit.spec import JobSpec
    from hpkit.validation import load_document

    spec = load_document(JobSpec, args.spec)
    name = args.output or f"{spec.name}.sbatch"
    script = render(spec, script_name=name, spec_path=str(Path(args.spec).resolve()))
    if args.output:
        _write_new(Path(args.output), script, mode=0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def _write_new(path: Path, text: str, mode: int = 0o644) -> None:
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


def job_workdir(spec: JobSpec) -> Path:
    """Where the job will run (sbatch's --chdir, else the directory it is submitted from)."""
    return (Path(spec.workdir) if spec.workdir else Path.cwd()).resolve()


def prepare_submission(spec_file: str | Path) -> tuple[JobSpec, Path, Path]:
    """Everything `hpkit submit` does before sbatch: check the spec, write its snapshot and the script.

    Returns (spec, script path, output directory). Nothing here depends on the node count
    (bench/bench_render_scale.py compares 2,048 nodes with 2).
    """
    import yaml

    from hpkit.render import render
    from hpkit.spec import JobSpec
    from hpkit.validation import load_document

    spec = load_document(JobSpec, spec_file)
    out_dir = (job_workdir(spec) / spec.output_dir).resolve()
    # A snapshot of the spec travels with the job: editing the YAML after submitting must not
    # change a job that is still pending.
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    spec_copy = out_dir / f"{spec.name}-{stamp}.yaml"
    script_path = out_dir / f"{spec.name}-{stamp}.sbatch"
    _write_new(spec_copy, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    _write_new(script_path, render(spec, script_name=str(script_path), spec_path=str(spec_copy)), mode=0o755)
    return spec, script_path, out_dir


def _submit(args: argparse.Namespace) -> int:
    from hpkit.job_index import JobNote, remember
    from hpkit.slurm import get_backend

    spec, script_path, out_dir = prepare_submission(args.spec)
    if spec.container is None and "PATH" not in spec.env:
        # sbatch exports this process's environment to the job: give it the launcher of the
        # environment that submits it, and refuse here rather than fail on every node.
        from hpkit.job_path import check_programs, job_path, required_programs

        os.environ["PATH"] = job_path(os.environ)
        check_programs(required_programs(spec.launcher, spec.command), os.environ["PATH"], job_workdir(spec))
    if args.dry_run:
        print(f"dry run: wrote {script_path}")
        return 0
    backend = get_backend(args.backend)
    job_id = backend.submit(script_path)
    print(f"submitted job {job_id} ({spec.name}, {spec.nodes} node(s) x {spec.ranks_per_node} rank(s))")
    print(f"  script: {script_path}")
    print(f"  output: {out_dir / f'{spec.name}-{job_id}.out'}", flush=True)
    # For `hpkit status` and `hpkit plot` once the controller has forgotten the job.
    problem = remember(JobNote(job_id, spec.name, str(script_path), str(job_workdir(spec))))
    if problem:
        print(
            f"hpkit submit: note: {problem}; `hpkit status {job_id}` will lose track of the training files "
            "once Slurm forgets the job (set HPKIT_STATE_DIR to a writable directory)",
            file=sys.stderr,
        )
    if not args.wait:
        return 0
    return _wait_for(backend, [job_id], args)


def _wait_for(backend, job_ids: list[str], args: argparse.Namespace) -> int:
    from hpkit.slurm import JobState, print_progress, wait_all

    # Output of one job at a time: following several would interleave their logs.
    follower = _LogFollower() if args.follow and len(job_ids) == 1 else None
    infos = wait_all(
        backend,
        job_ids,
        poll_s=args.poll,
        timeout_s=args.timeout,
        on_change=print_progress,
        on_poll=follower.remember if follower else None,
        on_tick=follower.pump_last if follower else None,
        outage_limit_s=args.outage_timeout,
    )
    if follower:
        # The last lines can land just after the state flips.
        time.sleep(0.3)
        follower.pump(infos[job_ids[0]])
    failed = [i for i in infos.values() if i.state != JobState.COMPLETED]
    if not failed:
        return 0
    return failed[0].exit_code or 1


class _LogFollower:
    """Prints what a job's output file gained since the last call."""

    def __init__(self) -> None:
        self.offset = 0
        self.last = None

    def remember(self, info) -> None:
        self.last = info
        self.pump(info)

    def pump_last(self) -> None:
        """Between polls: the file grows without asking Slurm anything."""
        if self.last is not None:
            self.pump(self.last)

    def pump(self, info) -> None:
        if not info.stdout:
            return
        try:
            with open(info.stdout, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        if chunk:
            self.offset += len(chunk)
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))
            sys.stdout.flush()


def _wait(args: argparse.Namespace) -> int:
    from hpkit.slurm import JobState, get_backend

    backend = get_backend(args.backend)
    if not args.follow or len(args.job_ids) > 1:
        return _wait_for(backend, list(args.job_ids), args)
    # The status line, live: progress for a training job, Slurm's state for any other.
    from hpkit.commands.watch import follow

    info = follow(
        backend,
        args.job_ids[0],
        poll_s=args.poll,
        timeout_s=args.timeout,
        outage_limit_s=args.outage_timeout,
    )
    return 0 if info.state == JobState.COMPLETED else info.exit_code or 1


def _status(args: argparse.Namespace) -> int:
    from hpkit.commands.watch import JobWatcher, line, record
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
    follower = _LogFollower()
    follower.remember(info)
    if not info.state.finished:
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
