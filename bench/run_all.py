"""`make bench`: run every benchmark in turn and print their ratios together at the end.

Each benchmark measures its two sides in the same run, alternating, and prints `RATIO name = x` or
`TIME name = x` lines; this runner only launches them (torchrun for the distributed ones, each with
its own TMPDIR) and collects those lines. A benchmark that fails is reported and the others still run.

    python3 bench/run_all.py [--only checkpoint,launch]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]

BENCHMARKS: dict[str, list[str]] = {
    "train_step": [*TORCHRUN, str(BENCH / "bench_train_step.py")],
    "launch": [sys.executable, str(BENCH / "bench_launch.py")],
    "checkpoint": [*TORCHRUN, str(BENCH / "bench_checkpoint.py")],
    "memory_checkpoint": [*TORCHRUN, str(BENCH / "bench_memory_checkpoint.py")],
    "check": [sys.executable, str(BENCH / "bench_check.py")],
    "render_scale": [sys.executable, str(BENCH / "bench_render_scale.py")],
    "gpu_mfu": [sys.executable, str(BENCH / "gpu_mfu.py")],
    "compat_smp": [*TORCHRUN, str(BENCH / "bench_compat_smp.py")],
    "hf_load": [*TORCHRUN, str(BENCH / "bench_hf_load.py")],
    "recovery": [sys.executable, str(BENCH / "bench_recovery.py")],
    "lora": [*TORCHRUN, str(BENCH / "bench_lora.py")],
    "plan_ranking": [sys.executable, str(BENCH / "bench_plan_ranking.py")],
    "slurm_polling": [sys.executable, str(BENCH / "bench_slurm_polling.py")],
    "plan_predict": [sys.executable, str(BENCH / "bench_plan_predict.py")],
}
# bench_train_step.py (owned with the runtime) prints `ratio hpkit/bare = x`; ours print `RATIO name = x`.
RESULT = re.compile(r"^(RATIO|TIME|ratio) .*$|^gpu_mfu: .*$|^skipped: .*$", re.MULTILINE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    args = p.parse_args()
    chosen = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHMARKS)
    unknown = [n for n in chosen if n not in BENCHMARKS]
    if unknown:
        print(f"run_all: --only: unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    summary: list[str] = []
    failed = []
    for name in chosen:
        if not Path(BENCHMARKS[name][-1]).exists():
            summary.append(f"{name}: not present ({BENCHMARKS[name][-1]})")
            failed.append(name)
            continue
        with tempfile.TemporaryDirectory(prefix=f"hpkit-bench-{name}-") as tmp:
            env = dict(os.environ, TMPDIR=tmp)
            env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO / "python"), env.get("PYTHONPATH")) if x)
            print(f"== {name}: {' '.join(BENCHMARKS[name][1:])}", flush=True)
            start = time.monotonic()
            proc = subprocess.run(BENCHMARKS[name], env=env, cwd=REPO, capture_output=True, text=True)
            took = time.monotonic() - start
        lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("W1")]
        print("\n".join(lines[-12:]), flush=True)
        found = RESULT.findall(proc.stdout)
        if proc.returncode != 0 or not found:
            print(proc.stderr[-3000:], file=sys.stderr)
            summary.append(f"{name}: FAILED (exit {proc.returncode}) after {took:.0f} s")
            failed.append(name)
            continue
        summary += [m.group(0) for m in RESULT.finditer(proc.stdout)]
        print(f"   ({took:.0f} s)", flush=True)
    print("\n== summary (machine: see BENCHMARKS.md)")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
