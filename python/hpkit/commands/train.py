"""`hpkit train`: parse the arguments, load the configuration, run (inside a job)."""

from __future__ import annotations

import argparse
import os

from hpkit.errors import SpecError
from hpkit.runtime.config import SPEC_ENV, RunConfig
from hpkit.spec import load_run_config


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run the training loop (inside a job).")
    parser.add_argument(
        "--config",
        default=os.environ.get(SPEC_ENV),
        help=f"job spec or training config YAML (default: ${SPEC_ENV}, which the sbatch script exports)",
    )
    parser.add_argument("--steps", type=int, help="override train.steps")
    return parser


def parse_args(argv: list[str], prog: str = "hpkit train") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(prog).parse_args(argv[1:] if argv and argv[0] == "train" else argv)


def main(argv: list[str], prog: str = "hpkit train") -> int:
    args = parse_args(argv, prog)
    if not args.config:
        raise SpecError(f"no config: pass --config job.yaml or export {SPEC_ENV}")
    cfg = _config(args)
    # torch loads only now: `--help` and config errors answer without it.
    from hpkit.runtime.run import run
    from hpkit.runtime.stay import stay_for_next_step

    while True:
        try:
            return run(cfg)
        except Exception as exc:
            # resilience.keep_survivors: this process stays for the next step, which has now taken it over.
            if not stay_for_next_step(cfg, exc):
                raise
        cfg = _config(args)  # read again, in the next step's environment


def _config(args: argparse.Namespace) -> RunConfig:
    cfg = load_run_config(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise SpecError("--steps must be at least 1")
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": args.steps})})
    return cfg
