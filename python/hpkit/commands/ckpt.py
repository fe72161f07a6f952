"""`hpkit ckpt verify|ls DIR`: check checkpoints offline against their commit records (no torch needed);
`hpkit ckpt export --hf CKPT OUT`: a checkpoint as a Hugging Face Llama, or a LoRA checkpoint as a PEFT
adapter (`--merge`: the base with the adapters merged in) (torch and the hf extra)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hpkit.errors import HpkitError
from hpkit.runtime.checkpoints.checkpoint_record import CheckpointReport, checkpoint_dirs, inspect


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Inspect hpkit checkpoints offline.")
    sub = parser.add_subparsers(dest="action", required=True)
    verify = sub.add_parser("verify", help="check every file of each checkpoint against its commit record")
    verify.add_argument("dir", help="a checkpoint root (checkpoint.dir) or one step-N directory")
    listing = sub.add_parser("ls", help="list checkpoints: step, size, layout, verification state")
    listing.add_argument("dir", help="a checkpoint root (checkpoint.dir) or one step-N directory")
    listing.add_argument("--quick", action="store_true", help="check record and sizes only, not checksums")
    for p in (verify, listing):
        p.add_argument("--json", action="store_true", help="print the result as JSON")
    export = sub.add_parser(
        "export", help="write a checkpoint as config.json + safetensors that transformers loads"
    )
    export.add_argument("--hf", action="store_true", required=True, help="Hugging Face Llama format")
    export.add_argument(
        "dir", help="a checkpoint root (its newest committed checkpoint) or one step-N directory"
    )
    export.add_argument("out", help="a new (or empty) directory to write")
    export.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="tensor type of the export (auto: as the checkpoint stores them)",
    )
    export.add_argument(
        "--max-shard-gib", type=float, default=5.0, help="largest safetensors file, GiB (default 5)"
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write the base with the adapters merged in (a whole model) instead of a "
        "PEFT adapter; reads the recorded base (model.init_from), which must be unchanged",
    )
    return parser


def parse_args(argv: list[str], prog: str = "hpkit ckpt") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(prog).parse_args(argv[1:] if argv and argv[0] == "ckpt" else argv)


def main(argv: list[str], prog: str = "hpkit ckpt") -> int:
    args = parse_args(argv, prog)
    root = Path(args.dir)
    if not root.exists():
        raise HpkitError(f"{root}: no such directory")
    if args.action == "export":
        return _export(root, Path(args.out), args.dtype, args.max_shard_gib, args.merge)
    dirs = checkpoint_dirs(root)
    if not dirs:
        raise HpkitError(
            f"{root}: no checkpoints here (no step-N directories, no {root.name}/hpkit-commit.json)"
        )
    quick = getattr(args, "quick", False)
    reports = [inspect(d, verify=not quick) for d in dirs]
    if quick:
        reports = [_sizes_only(r) for r in reports]
    if args.json:
        print(json.dumps([_as_json(r) for r in reports], indent=1))
    elif args.action == "ls":
        _print_table(reports, quick)
    else:
        for r in reports:
            _print_verdict(r)
    return 0 if all(r.ok for r in reports) else 1


def _export(root: Path, out: Path, dtype: str, max_shard_gib: float, merge: bool = False) -> int:
    if max_shard_gib <= 0:
        raise HpkitError(f"--max-shard-gib {max_shard_gib}: give a positive size")
    try:
        from hpkit.hf_export import export_hf
    except ImportError as exc:
        raise HpkitError(
            f"hpkit ckpt export needs torch and the hf extra ({exc.name} is missing): pip install 'hpkit[train,hf]'"
        ) from None
    done = export_hf(root, out, dtype, int(max_shard_gib * 2**30), merge=merge)
    if done.files == ["adapter_model.safetensors"]:
        print(
            f"{done.out}: PEFT adapter, {done.tensors} tensors ({_size(done.total_bytes)}, {done.dtype}) in "
            f"adapter_model.safetensors + adapter_config.json, from {done.step_dir}"
        )
        return 0
    print(
        f"{done.out}: {done.tensors} tensors ({_size(done.total_bytes)}, {done.dtype}) in {len(done.files)} "
        f"safetensors file(s) + config.json, from {done.step_dir}"
    )
    return 0


def _sizes_only(report: CheckpointReport) -> CheckpointReport:
    if report.record is None:
        return report
    problems = []
    for name, digest in sorted(report.record.files.items()):
        path = report.path / name
        size = path.stat().st_size if path.exists() else None
        if size != digest.size:
            problems.append(
                f"{name}: {'missing' if size is None else f'{size} bytes'}, the record says {digest.size}"
            )
    return CheckpointReport(report.path, report.step, report.record, problems)


def _state(report: CheckpointReport) -> str:
    if report.record is None:
        return "INCOMPLETE"
    return "ok" if not report.problems else "BAD"


def _print_verdict(report: CheckpointReport) -> None:
    if report.ok:
        assert report.record is not None
        print(f"{report.path}: ok ({len(report.record.files)} files, {_size(report.record.total_bytes)})")
        return
    print(f"{report.path}: {_state(report)}", file=sys.stdout)
    for problem in report.problems:
        print(f"  {problem}")


def _print_table(reports: list[CheckpointReport], quick: bool) -> None:
    rows = [("step", "size", "files", "world", "layout", "saved", "state")]
    for r in reports:
        rec = r.record
        layout = ",".join(f"{k}:{v}" for k, v in rec.layout.items() if v > 1) or "single" if rec else "-"
        saved = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.created)) if rec and rec.created else "-"
        )
        rows.append(
            (
                str(r.step if r.step is not None else "-"),
                _size(rec.total_bytes) if rec else "-",
                str(len(rec.files)) if rec else "-",
                str(rec.world_size) if rec else "-",
                layout,
                saved,
                _state(r) + (" (sizes)" if quick and rec and r.ok else ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for r in reports:
        for problem in r.problems:
            print(f"{r.path.name}: {problem}")


def _as_json(report: CheckpointReport) -> dict:
    rec = report.record
    return {
        "path": str(report.path),
        "step": report.step,
        "state": _state(report),
        "bytes": rec.total_bytes if rec else None,
        "files": len(rec.files) if rec else None,
        "world_size": rec.world_size if rec else None,
        "layout": rec.layout if rec else None,
        "problems": report.problems,
    }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
