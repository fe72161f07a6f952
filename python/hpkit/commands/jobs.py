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

from hpkit.errors import HpkitError, SlurmError


def _parser(command: str, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    if command in ("render", "submit"):
        parser.add_argument("spec", help="job spec (YAML)")
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
        parser.add_argument("--poll", type=float, default=1.0, help="seconds between polls (default 1)")
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
    from hpkit.spec import load_spec

    spec = load_spec(args.spec)
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


def _submit(args: argparse.Namespace) -> int:
    import yaml

    from hpkit.render import render
    from hpkit.slurm import get_backend
    from hpkit.spec import load_spec

    spec = load_spec(args.spec)
    base = Path(spec.workdir) if spec.workdir else Path.cwd()
    out_dir = (base / spec.output_dir).resolve()
    # A snapshot of the spec travels with the job: editing the YAML after submitting must not
    # change a job that is still pending.
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    spec_copy = out_dir / f"{spec.name}-{stamp}.yaml"
    script_path = out_dir / f"{spec.name}-{stamp}.sbatch"
    _write_new(spec_copy, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    _write_new(script_path, render(spec, script_name=str(script_path), spec_path=str(spec_copy)), mode=0o755)
    if args.dry_run:
        print(f"dry run: wrote {script_path}")
        return 0
    backend = get_backend(args.backend)
    job_id = backend.submit(script_path)
    print(f"submitted job {job_id} ({spec.name}, {spec.nodes} node(s) x {spec.ranks_per_node} rank(s))")
    print(f"  script: {script_path}")
    print(f"  output: {out_dir / f'{spec.name}-{job_id}.out'}", flush=True)
    if not args.wait:
        return 0
    return _wait_for(backend, job_id, args)


def _wait_for(backend, job_id: str, args: argparse.Namespace) -> int:
    from hpkit.slurm import JobState, print_progress, wait

    follower = _LogFollower() if args.follow else None
    info = wait(
        backend,
        job_id,
        poll_s=args.poll,
        timeout_s=args.timeout,
        on_change=print_progress,
        on_poll=follower.pump if follower else None,
    )
    if follower:
        # The last lines can land just after the state flips.
        time.sleep(0.3)
        follower.pump(info)
    if info.state == JobState.COMPLETED:
        return 0
    return info.exit_code or 1


class _LogFollower:
    """Prints what a job's output file gained since the last call."""

    def __init__(self) -> None:
        self.offset = 0

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
    if not args.follow:
        return _wait_for(backend, args.job_id, args)
    # The status line, live: progress for a training job, Slurm's state for any other.
    from hpkit.commands.watch import follow

    info = follow(backend, args.job_id, poll_s=args.poll, timeout_s=args.timeout)
    return 0 if info.state == JobState.COMPLETED else info.exit_code or 1


def _status(args: argparse.Namespace) -> int:
    from hpkit.commands.watch import JobWatcher, line, record
    from hpkit.slurm import get_backend

    info, prog = JobWatcher(get_backend(args.backend), args.job_id).poll()
    if args.json:
        print(json.dumps(record(info, prog), indent=2))
    else:
        print(line(info, prog))
    return 0


def _logs(args: argparse.Namespace) -> int:
    from hpkit.slurm import get_backend

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
    while True:
        follower.pump(info)
        if info.state.finished:
            return 0
        time.sleep(0.5)
        info = backend.info(args.job_id)


def _cancel(args: argparse.Namespace) -> int:
    from hpkit.slurm import get_backend

    get_backend(args.backend).cancel(args.job_id)
    print(f"cancelled job {args.job_id}")
    return 0
