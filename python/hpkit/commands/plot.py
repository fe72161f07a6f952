"""`hpkit plot INPUT... -o FILE`: training curves (job ids, metrics JSONL) or collective bandwidth (CSV, nccl-tests output).

An input is a Slurm job id (an hpkit training job the controller still knows), a metrics `.jsonl`, a
`.csv` from `hpkit bench collectives --csv` / `hpkit bench nccl-tests parse --csv`, or nccl-tests'
own output (any other file). One plot takes one kind; several inputs of it are overlaid.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hpkit.errors import HpkitError

FORMATS = ("png", "svg")
DEFAULT_SIZE = (1200, 900)
SIZE_RANGE = (100, 10000)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Plot training curves (job ids, metrics JSONL) or collective bandwidth (CSV, nccl-tests output).",
    )
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="job id, metrics .jsonl, bench .csv or nccl-tests output"
    )
    parser.add_argument("-o", "--output", required=True, help="image file to write (.png or .svg)")
    parser.add_argument("--format", choices=FORMATS, help="png or svg (default: from -o's suffix, else png)")
    parser.add_argument(
        "--size", default=f"{DEFAULT_SIZE[0]}x{DEFAULT_SIZE[1]}", help="WxH in pixels (default 1200x900)"
    )
    parser.add_argument(
        "--op", help="the collective, for nccl-tests output older than 2.13 that does not name it"
    )
    return parser


def parse_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    lo, hi = SIZE_RANGE
    if not match or not all(lo <= int(v) <= hi for v in match.groups()):
        raise HpkitError(
            f"--size {text!r}: give WIDTHxHEIGHT in pixels, each {lo}..{hi}, e.g. --size 1200x900"
        )
    return int(match.group(1)), int(match.group(2))


def output_format(output: str, fmt: str | None) -> str:
    suffix = Path(output).suffix.lower().lstrip(".")
    if fmt is None:
        if suffix in FORMATS:
            return suffix
        if suffix:
            raise HpkitError(
                f"-o {output}: .{suffix} is not a format hpkit plot writes: use .png or .svg, or --format"
            )
        return "png"
    if suffix in FORMATS and suffix != fmt:
        raise HpkitError(f"-o {output} and --format {fmt} disagree: make the suffix .{fmt}, or drop --format")
    return fmt


def parse_args(argv: list[str], prog: str = "hpkit plot") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(prog).parse_args(argv[1:] if argv and argv[0] == "plot" else argv)


def main(argv: list[str], prog: str = "hpkit plot") -> int:
    args = parse_args(argv, prog)
    size = parse_size(args.size)
    fmt = output_format(args.output, args.format)
    kinds = {_kind(i) for i in args.inputs}
    if len(kinds) > 1:
        raise HpkitError(
            "these inputs mix training metrics (job ids, .jsonl) and collective results (.csv, nccl-tests "
            "output): plot each kind on its own"
        )
    try:
        from hpkit import plot
    except ImportError as exc:
        raise HpkitError(f"hpkit plot needs matplotlib ({exc}): pip install 'hpkit[plot]'") from None
    dpi = plot.SVG_DPI if fmt == "svg" else plot.PNG_DPI
    labels = _labels(args.inputs)
    if kinds == {"training"}:
        runs = [_training_run(i, label, plot) for i, label in zip(args.inputs, labels, strict=True)]
        fig = plot.training_figure(runs, size, dpi)
    else:
        inputs = [_bench_input(i, label, args.op, plot) for i, label in zip(args.inputs, labels, strict=True)]
        fig = plot.collectives_figure(inputs, size, dpi)
    out = Path(args.output)
    try:
        plot.save(fig, out, fmt)
    except OSError as exc:
        raise HpkitError(
            f"cannot write {out}: {exc.strerror or exc}: choose a writable place with -o"
        ) from None
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _kind(text: str) -> str:
    if text.isdigit() or text.endswith(".jsonl"):
        return "training"
    return "collectives"


def _labels(inputs: list[str]) -> list[str]:
    """Legend labels: the file name without suffix, or the path as given where two names coincide."""
    short = [f"job {t}" if t.isdigit() else Path(t).stem for t in inputs]
    return [s if short.count(s) == 1 else t for s, t in zip(short, inputs, strict=True)]


def _training_run(text: str, label: str, plot):
    from hpkit.metrics.file import read_metrics

    if not text.isdigit():
        return plot.TrainingRun(label, read_metrics(Path(text)))
    from hpkit.jobs.files import locate
    from hpkit.runtime.checkpoints.checkpoint_record import checkpoint_dirs

    files = locate(text)
    if files is None:
        raise HpkitError(
            f"job {text}: not an hpkit training job that slurmctld still knows (it forgets ended jobs after "
            "MinJobAge) or that `hpkit submit` noted: give its metrics .jsonl instead"
        )
    run = plot.TrainingRun(label, read_metrics(files.metrics_path))
    if files.checkpoint_dir is not None:
        for directory in checkpoint_dirs(files.checkpoint_dir):
            match = re.fullmatch(r"step-(\d+)", directory.name)
            if match and (directory / "hpkit-commit.json").is_file():
                run.checkpoint_steps.add(int(match.group(1)))
    return run


def _bench_input(text: str, label: str, op: str | None, plot):
    from hpkit.netbench import nccl_tests
    from hpkit.netbench.results import COLUMNS, from_csv

    path = Path(text)
    if not path.is_file():
        raise HpkitError(
            f"{text}: no such file: give a bench .csv, nccl-tests output, a metrics .jsonl or a job id"
        )
    content = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".csv":
        header = content.splitlines()[0].split(",") if content else []
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise HpkitError(
                f"{text}: a CSV without the columns {', '.join(missing)}: write it with "
                "`hpkit bench collectives --csv` or `hpkit bench nccl-tests parse --csv`"
            )
        try:
            rows = from_csv(content)
        except (ValueError, KeyError) as exc:
            raise HpkitError(f"{text}: a row does not parse ({exc}): is the file cut short?") from None
    else:
        rows = nccl_tests.rows_of(nccl_tests.parse(content, op=op, source=text))
    if not rows:
        raise HpkitError(f"{text}: no measurements in it")
    return plot.BenchInput(label, rows)
