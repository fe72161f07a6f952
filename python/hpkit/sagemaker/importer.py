"""`hpkit import-sagemaker ESTIMATOR [-o SPEC]`: a SageMaker estimator description → an hpkit job spec.

Warnings (what did not carry over, and what to do instead) go to stderr and into the spec's header,
so that they travel with the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from hpkit.sagemaker.convert import Imported, convert
from hpkit.sagemaker.estimator import Estimator
from hpkit.validation import load_document


def spec_text(imported: Imported, source: str) -> str:
    header = [f"# Imported from the SageMaker estimator {source} by `hpkit import-sagemaker`."]
    if imported.warnings:
        header.append("# Not carried over (review before submitting):")
        header += [f"#   - {w.line()}" for w in imported.warnings]
    header += [f"# Note: {note}" for note in imported.notes]
    body = yaml.safe_dump(imported.data, sort_keys=False, default_flow_style=None, width=100)
    return "\n".join(header) + "\n" + body


def parse_args(argv: list[str], prog: str = "hpkit import-sagemaker") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("estimator", help="the estimator's arguments as JSON or YAML")
    parser.add_argument("-o", "--output", help="write the job spec here (default: print it)")
    parser.add_argument("--name", help="the job name (default: base_job_name, else the entry point's name)")
    return parser.parse_args(argv[1:])


def main(argv: list[str], prog: str = "hpkit import-sagemaker") -> int:
    args = parse_args(argv, prog)
    imported = convert(load_document(Estimator, args.estimator), source=args.estimator, name=args.name)
    text = spec_text(imported, args.estimator)
    for warning in imported.warnings:
        print(f"{prog}: warning: {warning.line()}", file=sys.stderr)
    for note in imported.notes:
        print(f"{prog}: note: {note}", file=sys.stderr)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out} ({len(imported.warnings)} warning(s))", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
