"""`hpkit check`: run one profile's checks (or a chosen few) and report them; exit 1 when any failed."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from hpkit.arg_types import byte_size, positive_float, positive_int
from hpkit.checks.context import PROFILES, Context, Roots
from hpkit.checks.fleet import DEFAULT_BANDWIDTH_FRACTION
from hpkit.netbench.pairs import DEFAULT_ROUNDS, DEFAULT_SIZE

USAGE_EXIT = 2
# Where a node's checks read the system from, when not /: a site (or a Slurm TaskProlog) may point one
# node at another tree, e.g. the GPU driver's files inside a container image.
SYSROOT_ENV = "HPKIT_SYSROOT"


def _names(values: list[str] | None) -> list[str]:
    return [name.strip() for value in values or [] for name in value.split(",") if name.strip()]


def _fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError("must be a fraction of the median, in (0, 1]")
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
        default=None,
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
        "--timeout", type=positive_float, default=3.0, metavar="S", help="limit per probe command (3)"
    )
    parser.add_argument(
        "--imds-timeout",
        type=positive_float,
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
    parser.add_argument(
        "--sysroot",
        type=Path,
        metavar="DIR",
        help="read /proc, /sys, /opt, /etc, /var/log and /usr under DIR (a mounted image, a node's snapshot); "
        f"default: ${SYSROOT_ENV} if set",
    )
    fleet = parser.add_argument_group(
        "every node at once",
        "--all-nodes submits one Slurm job with a task per node that runs the compute profile there, then "
        "prints which nodes passed, warned and failed each check, which differ from the others, and an "
        "--exclude= list (exit 1 when it is not empty)",
    )
    fleet.add_argument("--all-nodes", action="store_true", help="check every node through Slurm")
    fleet.add_argument(
        "--partition", metavar="P", help="the partition's nodes (default: the default partition)"
    )
    which = fleet.add_mutually_exclusive_group()
    which.add_argument(
        "--nodes", type=positive_int, metavar="N", help="N nodes Slurm picks (default: all up)"
    )
    which.add_argument("--nodelist", metavar="LIST", help="these nodes (Slurm host list: node[1-4,9])")
    fleet.add_argument(
        "--bandwidth", action="store_true", help="also time all_reduce between pairs of nodes, a few pairings"
    )
    fleet.add_argument(
        "--bandwidth-threshold",
        type=_fraction,
        default=DEFAULT_BANDWIDTH_FRACTION,
        metavar="F",
        help=f"flag nodes whose best pair reaches less than F x the median busbw ({DEFAULT_BANDWIDTH_FRACTION})",
    )
    fleet.add_argument(
        "--bandwidth-rounds",
        type=positive_int,
        default=DEFAULT_ROUNDS,
        metavar="R",
        help=f"pairings to run ({DEFAULT_ROUNDS})",
    )
    fleet.add_argument(
        "--bandwidth-size",
        type=byte_size,
        default=DEFAULT_SIZE,
        metavar="BYTES",
        help=f"all_reduce size ({DEFAULT_SIZE})",
    )
    fleet.add_argument(
        "--output-dir",
        type=Path,
        default=Path("hpkit-check-nodes"),
        metavar="DIR",
        help="where the nodes write their reports; on the shared filesystem (./hpkit-check-nodes)",
    )
    fleet.add_argument(
        "--time-limit", default="00:10:00", metavar="T", help="the job's time limit (00:10:00)"
    )
    fleet.add_argument(
        "--wait-timeout",
        type=positive_float,
        default=900.0,
        metavar="S",
        help="cancel the job if it has not ended after S seconds, e.g. waiting for busy nodes (900)",
    )
    # Single system roots, for tests and for checking a mounted image from outside; they beat --sysroot.
    for root in ("proc", "sys", "opt", "etc", "var-log", "usr"):
        parser.add_argument(f"--{root}-root", type=Path, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str], prog: str = "hpkit check") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name), usage
    errors included: each exits 2 after the usage and one line, as argparse's own do."""
    from hpkit.checks.registry import all_checks

    parser = build_parser(prog)
    args = parser.parse_args(argv[1:] if argv and argv[0] == "check" else argv)
    unknown = sorted(set(_names(args.only) + _names(args.skip)) - set(all_checks()))
    if unknown:
        parser.error(f"unknown check(s): {', '.join(unknown)}; see `{prog} --list`")
    fleet_only = [
        flag
        for flag, given in (
            ("--partition", args.partition),
            ("--nodes", args.nodes),
            ("--nodelist", args.nodelist),
            ("--bandwidth", args.bandwidth),
        )
        if given
    ]
    if fleet_only and not args.all_nodes:
        parser.error(f"{fleet_only[0]} goes with --all-nodes; add it")
    if args.all_nodes and args.profile not in (None, "compute"):
        parser.error("--all-nodes runs the compute profile on each node; drop --profile")
    return args


def main(argv: list[str] | None = None, prog: str = "hpkit check") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv, prog)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 after --help
        return int(exc.code or 0)

    from hpkit.checks.registry import all_checks

    catalogue = all_checks()
    only, skip = _names(args.only), _names(args.skip)
    if args.all_nodes:
        return _all_nodes(args)
    args.profile = args.profile or "login"
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
    sysroot = args.sysroot or (Path(os.environ[SYSROOT_ENV]) if os.environ.get(SYSROOT_ENV) else None)
    if sysroot is not None and not sysroot.is_dir():
        where = "--sysroot" if args.sysroot else f"${SYSROOT_ENV}"
        print(
            f"{prog}: error: {where}: {sysroot} is not a folder; point it at a system tree or unset it",
            file=sys.stderr,
        )
        return USAGE_EXIT
    defaults = Roots.under(sysroot) if sysroot is not None else Roots()
    roots = Roots(
        **{
            field: getattr(args, f"{field}_root") or getattr(defaults, field)
            for field in ("proc", "sys", "opt", "etc", "var_log", "usr")
        },
        tree=defaults.tree,
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
    show(outcomes, args.profile, time.monotonic() - started, args.format or "auto", sysroot=sysroot)
    return exit_code(outcomes)


def _forwarded(args: argparse.Namespace) -> tuple[str, ...]:
    """This command's options that each node's own `hpkit check` should get too."""
    out: list[str] = []
    for name in _names(args.only):
        out += ["--only", name]
    for name in _names(args.skip):
        out += ["--skip", name]
    out += ["--timeout", f"{args.timeout:g}", "--imds-timeout", f"{args.imds_timeout:g}"]
    if args.shared_fs:
        out += ["--shared-fs", str(args.shared_fs)]
    for path in args.disk or []:
        out += ["--disk", str(path)]
    return tuple(out)


def _all_nodes(args: argparse.Namespace) -> int:
    from hpkit.commands import check_nodes

    req = check_nodes.Request(
        partition=args.partition,
        nodes=args.nodes,
        nodelist=args.nodelist,
        check_args=_forwarded(args),
        output_dir=args.output_dir.absolute(),
        time_limit=args.time_limit,
        wait_timeout_s=args.wait_timeout,
        bandwidth=args.bandwidth,
        rounds=args.bandwidth_rounds,
        size_bytes=args.bandwidth_size,
        fraction=args.bandwidth_threshold,
    )
    from hpkit.errors import HpkitError

    try:
        gathered = check_nodes.run(req)
    except HpkitError as exc:  # also reached from `python -m hpkit.checks`, which has no cli.main around it
        print(f"hpkit check --all-nodes: error: {exc}", file=sys.stderr)
        return 1
    import json

    document = {
        "job_id": gathered.job_id,
        "job_state": gathered.state,
        **gathered.report.to_json(),
        "not_checked": gathered.not_checked,
    }
    text = json.dumps(document, indent=2)
    # The whole record stays next to the nodes' own files, whichever form the screen got.
    saved = gathered.files / f"report-{gathered.job_id}.json"
    saved.write_text(text + "\n", encoding="utf-8")
    if args.format == "json":
        print(text)
    else:
        check_nodes.print_report(gathered)
        print(f"full report: {saved}")
    return 0 if gathered.report.ok else 1
