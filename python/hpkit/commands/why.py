"""`hpkit why JOB`: why a job ended, with the lines that say so (hpkit.jobs.why has the rule)."""

from __future__ import annotations

import argparse
import json

from hpkit import arg_types


def parse_args(argv: list[str], prog: str = "hpkit why") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print why a job ended: the verdict, then each line it rests on (file:line or the Slurm "
        "command), then the sources that could not be read. Exit status 0 whenever a verdict is printed, "
        "'unknown' included; 1 for a job id nothing knows.",
    )
    parser.add_argument(
        "job_id",
        type=arg_types.job_id,
        help="Slurm job id; JOB_TASK for a task of a job array, JOB for a table of its tasks",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    return parser.parse_args(argv[1:])


def main(argv: list[str], prog: str = "hpkit why") -> int:
    args = parse_args(argv, prog)

    from hpkit.jobs.files import array_tasks
    from hpkit.jobs.why_gather import explain

    tasks = array_tasks(args.job_id.strip())
    if tasks is not None:
        # A sweep's job array: a row per task with the first line of its verdict (`hpkit why JOB_TASK`: all of it).
        from hpkit.jobs.sweep_status import format_rows, task_rows
        from hpkit.slurm import get_backend

        rows = task_rows(get_backend(), tasks, why=lambda task: explain(task).summary)
        print(json.dumps([r.to_json() for r in rows], indent=2) if args.json else format_rows(rows))
        return 0
    verdict = explain(args.job_id)
    if args.json:
        print(json.dumps(verdict.to_json(), indent=2))
    else:
        print("\n".join(verdict.lines()))
    return 0
