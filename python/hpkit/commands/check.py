"""`hpkit check`: run one profile's checks (or a chosen few) and report them; exit 1 when any failed."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hpkit.checks.context import PROFILES, Context, Roots

USAGE_EXIT = 2


def _names(values: list[str] | None) -> list[str]:
    return [name.strip() for value in values or [] for name in value.split(",") if name.strip()]


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Check whether this node can run distributed training; every finding comes with a fix.",
        epilog="Exit status: 0 nothing failed, 1 something failed, 2 usage error.",
    )
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default="login",
        help="login: cluster access, no GPU needed (default); compute: a GPU node; container: inside the "
        "training container",
    )
    parser.add_argument(
        "--only", action="append", metavar="NAMES", help="run only these checks (comma-separated)"
    )
    parser.add_argument(
        "--skip", action="append", metavar="NAMES", help="leave these checks out (comma-separated)"
    )
    parser.add_argument("--list", action="store_true", help="list the checks and their profiles, then exit")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_const", dest="format", const="json", help="print JSON")
    out.add_argument(
        "--plain", action="store_const", dest="format", const="plain", help="plain text, no table"
    )
    out.add_argument(
        "--table", action="store_const", dest="format", const="table", help="a Rich table even when piped"
    )
    parser.add_argument(
        "--timeout", type=_positive, default=3.0, metavar="S", help="limit per probe command (3)"
    )
    parser.add_argument(
        "--imds-timeout",
        type=_positive,
        default=0.8,
        metavar="S",
        help="limit for the metadata-service probe (0.8)",
    )
    parser.add_argument(
        "--shared-fs", type=Path, metavar="PATH", help="the shared filesystem to expect (any Lustre/NFS)"
    )
    parser.add_argument(
        "--disk", type=Path, action="append", metavar="PATH", help="a folder whose free space matters"
    )
    # System roots, for tests and for checking a mounted image from outside.
    for root in ("proc", "sys", "opt", "etc", "var-log", "usr"):
        parser.add_argument(f"--{root}-root", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None, prog: str = "hpkit check") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "check":
        argv = argv[1:]
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 after --help
        return int(exc.code or 0)

    from hpkit.checks.registry import all_checks

    catalogue = all_checks()
    only, skip = _names(args.only), _names(args.skip)
    unknown = sorted(set(only + skip) - set(catalogue))
    if unknown:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: unknown check(s): {', '.join(unknown)}; see `{prog} --list`", file=sys.stderr)
        return USAGE_EXIT
    if args.list:
        width = max(map(len, catalogue))
        for chk in catalogue.values():
            print(f"{chk.name:<{width}}  {chk.title}  [{', '.join(chk.profiles)}]")
        return 0

    # --only picks from every check (the user named them); otherwise the profile decides.
    chosen = (
        [catalogue[n] for n in catalogue if n in only]
        if only
        else [c for c in catalogue.values() if args.profile in c.profiles]
    )
    chosen = [c for c in chosen if c.name not in skip]
    defaults = Roots()
    roots = Roots(
        **{
            field: getattr(args, f"{field}_root") or getattr(defaults, field)
            for field in ("proc", "sys", "opt", "etc", "var_log", "usr")
        }
    )
    ctx = Context(
        profile=args.profile,
        roots=roots,
        probe_timeout=args.timeout,
        imds_timeout=args.imds_timeout,
        shared_fs=args.shared_fs,
        disk_paths=tuple(args.disk) if args.disk else None,
    )

    from hpkit.checks.report import exit_code, show
    from hpkit.checks.runner import run_checks

    started = time.monotonic()
    outcomes = run_checks(chosen, ctx)
    show(outcomes, args.profile, time.monotonic() - started, args.format or "auto")
    return exit_code(outcomes)
