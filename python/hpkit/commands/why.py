"""`hpkit why JOB`: why a job ended, with the lines that say so (hpkit.jobs.why has the rule)."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str], prog: str = "hpkit why") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print why a job ended: the verdict, then each line it rests on (file:line or the Slurm "
        "command), then the sources that could not be read. Exit status 0 whenever a verdict is printed, "
        "'unknown' included; 1 for a job id nothing knows.",
    )
    parser.add_argument("job_id", help="Slurm job id")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    args = parser.parse_args(argv[1:])

    from hpkit.jobs.why_gather import explain

    verdict = explain(args.job_id)
    if args.json:
        print(json.dumps(verdict.to_json(), indent=2))
    else:
        print("\n".join(verdict.lines()))
    return 0
