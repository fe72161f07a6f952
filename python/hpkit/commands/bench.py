"""`hpkit bench collectives | nccl-tests render | nccl-tests parse`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from hpkit.arg_types import byte_size, positive_int
from hpkit.errors import SpecError

USAGE = """usage: hpkit bench SUBCOMMAND [ARGS]

subcommands:
  collectives         time all_reduce, all_gather, reduce_scatter, broadcast, all_to_all (this process group)
  nccl-tests render   write an sbatch script that runs nccl-tests with srun --mpi=pmix
  nccl-tests parse    turn nccl-tests output into the same table, CSV and JSON

Run `hpkit bench SUBCOMMAND --help` for its options."""


def parse_args(argv: list[str], prog: str = "hpkit bench") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name); the
    subcommand is `args.subcommand`. Usage errors exit 2 after one message, as argparse's own do."""
    rest = argv[1:] if argv and argv[0] == "bench" else argv
    if not rest or rest[0] in ("-h", "--help", "help"):
        print(USAGE)
        raise SystemExit(0 if rest else 2)
    sub, rest = rest[0], rest[1:]
    if sub == "nccl-tests":
        if rest[:1] not in (["render"], ["parse"]):
            print(f"{prog} nccl-tests: give `render` or `parse`\n\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        sub, rest = f"nccl-tests {rest[0]}", rest[1:]
    if sub not in SUBCOMMANDS:
        print(f"{prog}: unknown subcommand {sub!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    args = SUBCOMMANDS[sub][0](rest, f"{prog} {sub}")
    args.subcommand = sub
    return args


def main(argv: list[str], prog: str = "hpkit bench") -> int:
    try:
        args = parse_args(argv, prog)
    except SystemExit as exc:  # a usage message, or --help
        if isinstance(exc.code, str):
            raise
        return int(exc.code or 0)
    return SUBCOMMANDS[args.subcommand][1](args)


def _ops(text: str) -> tuple[str, ...]:
    from hpkit.netbench.bandwidth import OPS

    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown collective(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(OPS)}"
        )
    return ops


def _collectives_parser(prog: str) -> argparse.ArgumentParser:
    from hpkit.netbench.collectives import DEFAULT_OPS, DTYPES

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time collectives over a sweep of sizes and report time, algbw and busbw as nccl-tests "
        "does. Launch it with torchrun or srun (one process per rank), or in a Slurm job: "
        "slurm/jobs/collectives.yaml.",
    )
    parser.add_argument(
        "--ops", type=_ops, default=DEFAULT_OPS, help=f"comma-separated (default: {','.join(DEFAULT_OPS)})"
    )
    parser.add_argument(
        "-b", "--min-bytes", type=byte_size, default=byte_size("8"), help="smallest size (default 8)"
    )
    parser.add_argument(
        "-e", "--max-bytes", type=byte_size, default=byte_size("64M"), help="largest (default 64M)"
    )
    parser.add_argument("-f", "--factor", type=positive_int, default=2, help="size step factor (default 2)")
    parser.add_argument("-n", "--iters", type=positive_int, default=20, help="timed iterations (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    parser.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float", help="element type")
    parser.add_argument("--no-check", action="store_true", help="skip checking each result's values")
    parser.add_argument("--csv", help="also write the rows as CSV here (rank 0)")
    parser.add_argument("--json", help="also write the rows as JSON here (rank 0)")
    return parser


def _collectives_args(argv: list[str], prog: str) -> argparse.Namespace:
    from hpkit.sizes import sweep

    parser = _collectives_parser(prog)
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("argument -w/--warmup: must be 0 or more")
    try:
        args.sizes = tuple(sweep(args.min_bytes, args.max_bytes, args.factor))
    except ValueError as exc:
        parser.error(f"argument -b/-e/-f: {exc}")
    return args


def _collectives(args: argparse.Namespace) -> int:
    from hpkit.netbench.collectives import SweepConfig

    cfg = SweepConfig(args.ops, args.sizes, args.iters, args.warmup, args.dtype, not args.no_check)

    from hpkit.netbench.collectives import measure
    from hpkit.netbench.results import table, write_outputs
    from hpkit.runtime.env import distributed

    with distributed() as run:
        rows = measure(cfg, run.device.torch_device(), run.device.backend)
        if run.launch.is_rank0:
            print(
                f"# hpkit bench collectives: {run.launch.world_size} rank(s), backend {run.device.backend}, "
                f"device {run.device.type}, dtype {cfg.dtype}, iters {cfg.iters}, warmup {cfg.warmup}"
            )
            sys.stdout.write(table(rows))
            for op in cfg.ops:
                busbw = [r.busbw_gbps for r in rows if r.op == op]
                print(f"# Avg bus bandwidth {op:<15}: {sum(busbw) / len(busbw):.6f} GB/s")
            write_outputs(rows, args.csv, args.json)
            sys.stdout.flush()
    bad = sum(r.wrong or 0 for r in rows)
    if bad:
        if run.launch.is_rank0:
            print(
                f"# hpkit bench collectives: {bad} wrong element(s): the collectives returned bad data",
                file=sys.stderr,
            )
        return 1
    return 0


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _render_args(argv: list[str], prog: str) -> argparse.Namespace:
    from hpkit.netbench.nccl_job import DEFAULT_TESTS

    parser = argparse.ArgumentParser(prog=prog, description="Render an sbatch script that runs nccl-tests.")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--name", default="nccl-tests")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--time", default="00:30:00", help="Slurm time limit (default 00:30:00)")
    parser.add_argument("--no-exclusive", action="store_true", help="share the nodes (default: exclusive)")
    parser.add_argument("--output-dir", default="logs")
    parser.add_argument("--container-image", help="pyxis image (.sqsh or registry reference)")
    parser.add_argument("--mount", action="append", default=[], help="container mount src:dst (repeatable)")
    parser.add_argument("--env", action="append", type=_env_pair, default=[], help="KEY=VALUE (repeatable)")
    parser.add_argument("--bin-dir", default="/opt/nccl-tests/build", help="where all_reduce_perf etc. are")
    parser.add_argument(
        "--tests", default=",".join(DEFAULT_TESTS), help="comma-separated nccl-tests binaries"
    )
    parser.add_argument("-b", "--min-bytes", type=byte_size, default=byte_size("8"))
    parser.add_argument("-e", "--max-bytes", type=byte_size, default=byte_size("8G"))
    parser.add_argument("-f", "--factor", type=int, default=2)
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-w", "--warmup", type=int, default=5)
    parser.add_argument("-o", "--output", help="write the script here instead of printing it")
    return parser.parse_args(argv)


def _render(args: argparse.Namespace) -> int:
    from hpkit.netbench.nccl_job import NcclTestsArgs, render_nccl_tests
    from hpkit.slurm.job import SlurmJob
    from hpkit.validation import parse_document

    data: dict = {
        "name": args.name,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "launcher": "srun",
        "time_limit": args.time,
        "exclusive": not args.no_exclusive,
        "output_dir": args.output_dir,
        "env": dict(args.env),
        # What each task runs first; the template loops over --tests.
        "command": ["all_reduce_perf"],
    }
    for key, value in (("partition", args.partition), ("account", args.account)):
        if value:
            data[key] = value
    if args.container_image:
        data["container"] = {"image": args.container_image, "mounts": args.mount}
    spec = parse_document(SlurmJob, data, source="options")
    tests = tuple(t.strip() for t in args.tests.split(",") if t.strip())
    nccl_args = NcclTestsArgs(
        tests, args.min_bytes, args.max_bytes, args.factor, args.iters, args.warmup, bin_dir=args.bin_dir
    )
    script = render_nccl_tests(spec, nccl_args, script_name=args.output or f"{args.name}.sbatch")
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script, encoding="utf-8")
        path.chmod(0o755)
        print(f"wrote {path}: submit it with sbatch {path}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def _parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description="Read nccl-tests output into a table, CSV and JSON."
    )
    parser.add_argument("log", help="nccl-tests output (a job's .out file); - for stdin")
    parser.add_argument(
        "--op", help="the collective, for nccl-tests before 2.13 (their output does not name it)"
    )
    parser.add_argument("--csv", help="write the rows as CSV here")
    parser.add_argument("--json", help="write the rows as JSON here")
    return parser.parse_args(argv)


def _parse(args: argparse.Namespace) -> int:
    from hpkit.netbench.nccl_tests import parse, rows_of
    from hpkit.netbench.results import table, write_outputs

    if args.log == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.log).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise SpecError(f"{args.log}: cannot read: {exc.strerror}") from None
    runs = parse(text, op=args.op, source=args.log)
    rows = rows_of(runs)
    sys.stdout.write(table(rows))
    for run in runs:
        avg = f"{run.avg_busbw_gbps:g}" if run.avg_busbw_gbps is not None else "n/a"
        print(f"# {run.op}: {run.ranks} rank(s), {len(run.rows)} row(s), nccl-tests' avg busbw {avg} GB/s")
    write_outputs(rows, args.csv, args.json)
    return 0


# subcommand -> (its command line's parser, what runs it)
SUBCOMMANDS: dict[
    str, tuple[Callable[[list[str], str], argparse.Namespace], Callable[[argparse.Namespace], int]]
] = {
    "collectives": (_collectives_args, _collectives),
    "nccl-tests render": (_render_args, _render),
    "nccl-tests parse": (_parse_args, _parse),
}
