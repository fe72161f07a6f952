"""Hang drills: how often the watchdog names the right culprit, and how fast, per fault type; and whether a
long clean run under load raises a false alarm.

Each trial is a fresh `hpkit train` on two "nodes" x two ranks (FSDP x TP, gloo; bench/_hang_trials.py) with
`resilience.hang.min_s` = --min-s; the fault hits a rank (or a node) that rotates over the trials. Detection is
measured from the fault injector's raw timestamp (the drill's clock just before SIGSTOP, or the faulty rank's
own HPKIT_FAULT_LOG line) to the moment verdict.json lands (its mtime), which is when the one-line verdict is
printed. Targets: 20/20 correct per fault type, p95 <= 15 s.

The clean run: the same job with a checkpoint save every 5 steps and a CPU hog (one busy process per core),
for --clean-seconds; any hang folder is a false alarm. Target: 0.

    python3 bench/bench_hang_detection.py [--trials 20] [--faults sigstop,sleep,skip,frozen-node]
        [--min-s 10] [--clean-seconds 600] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _hang_trials import FAULTS, NODES, PER_NODE, Trial, beats, launch, run_trial, stop_all


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def trials(fault: str, count: int, min_s: float, root: Path) -> list[Trial]:
    done = []
    for i in range(count):
        target = i % len(NODES) if fault == "frozen-node" else i % (len(NODES) * PER_NODE)
        trial = run_trial(Trial(fault, target), root / f"{fault}-{i}", min_s)
        done.append(trial)
        got = trial.verdict["culprits"] if trial.verdict else None
        print(
            f"{fault:12s} trial {i + 1:2d}: target {target} named {got} "
            f"{'ok' if trial.correct else 'WRONG'} in {trial.detection_s:5.2f} s",
            flush=True,
        )
    return done


def _hog(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def clean_run(seconds: float, min_s: float, root: Path) -> dict:
    out = root / "clean"
    agents = launch(out, min_s, {}, checkpoint_every=5)
    stop_at = time.time() + seconds
    hogs = [multiprocessing.Process(target=_hog, args=(stop_at,)) for _ in range(os.cpu_count() or 1)]
    for h in hogs:
        h.start()
    try:
        while time.time() < stop_at and all(a.proc.poll() is None for a in agents):
            time.sleep(1)
        seen = beats(out)
    finally:
        stop_all(agents)
        for h in hogs:
            h.join()
    hangs = [p.name for p in (out / "hangs").glob("*-step*")]
    saves = len(list((out / "ckpt").glob("step-*"))) if (out / "ckpt").exists() else 0
    steps = min((b["step"] for b in seen.values()), default=0)
    died = [a.proc.returncode for a in agents if a.proc.returncode not in (None, -9)]
    return {
        "seconds": seconds,
        "steps": steps,
        "false_alarms": len(hangs),
        "hangs": hangs,
        "saves_kept": saves,
        "agents_died": died,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--min-s", type=float, default=10.0)
    p.add_argument("--clean-seconds", type=float, default=600.0, help="0 skips the clean run")
    p.add_argument("--json", type=Path, help="write the raw per-trial timestamps here")
    args = p.parse_args()
    report: dict = {"min_s": args.min_s, "faults": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for fault in [f for f in args.faults.split(",") if f]:
            done = trials(fault, args.trials, args.min_s, root)
            times = [t.detection_s for t in done if t.verdict is not None]
            report["faults"][fault] = {
                "correct": sum(t.correct for t in done),
                "trials": len(done),
                "raw": [
                    {
                        "target": t.target,
                        "injected_at": t.injected_at,
                        "verdict_at": t.verdict_at,
                        "culprits": t.verdict["culprits"] if t.verdict else None,
                        "reason": t.verdict["reason"] if t.verdict else None,
                    }
                    for t in done
                ],
                "p50": statistics.median(times) if times else None,
                "p95": percentile(times, 0.95) if times else None,
                "max": max(times) if times else None,
            }
        if args.clean_seconds > 0:
            report["clean"] = clean_run(args.clean_seconds, args.min_s, root)
    print(f"\nmin_s {args.min_s:g} s; detection = verdict written - fault injected")
    print(f"{'fault':12s} {'correct':>9s} {'p50 s':>7s} {'p95 s':>7s} {'max s':>7s}")
    for fault, r in report["faults"].items():
        cells = [f"{r[k]:7.2f}" if r[k] is not None else "    n/a" for k in ("p50", "p95", "max")]
        print(f"{fault:12s} {r['correct']:>4d}/{r['trials']:<4d} {' '.join(cells)}")
    if "clean" in report:
        c = report["clean"]
        print(
            f"clean run under a CPU hog: {c['seconds']:.0f} s, {c['steps']} steps, checkpoint every 5 steps: "
            f"{c['false_alarms']} false alarms"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
