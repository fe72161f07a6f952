"""What the hang watchdog costs a training step: `hpkit train` with `resilience.hang.enabled` on and off, side by
side, alternating (2 ranks, torchrun, gloo, the debug Llama at dim 256, 4 blocks, seq 256, local batch 4).

The watchdog is a thread that wakes once a second to write one small file and read the others; the train loop
only sets three attributes per step. Target: on / off >= 0.99 in tokens/s.

    python3 bench/bench_hang_watchdog.py [--rounds 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ, LOCAL_BATCH, PROCS = 256, 4, 2


def run(enabled: bool, steps: int, out: Path) -> float:
    cfg = {
        "name": "watchdog-bench",
        "output_dir": str(out),
        "parallelism": {"dp_shard": PROCS},
        "model": {
            "name": "debug",
            "dim": 256,
            "n_layers": 4,
            "n_heads": 8,
            "vocab_size": 2048,
            "seq_len": SEQ,
        },
        "train": {
            "steps": steps,
            "local_batch_size": LOCAL_BATCH,
            "mixed_precision": "fp32",
            "log_every": 1,
            "tensorboard": False,
            "metrics_file": str(out / "metrics.jsonl"),
        },
        "resilience": {"hang": {"enabled": enabled}},
    }
    path = out / "config.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(out))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO / "python"), env.get("PYTHONPATH")) if x)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PROCS}"]
    subprocess.run(
        [*cmd, "-m", "hpkit", "train", "--config", str(path)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=REPO,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "event" not in r]
    return PROCS * LOCAL_BATCH * SEQ / statistics.median(times[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    on: list[float] = []
    off: list[float] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for rnd in range(args.rounds):
            for enabled in (True, False) if rnd % 2 == 0 else (False, True):
                out = tmp / f"{enabled}-{rnd}"
                out.mkdir()
                (on if enabled else off).append(run(enabled, args.steps, out))
                print(
                    f"round {rnd + 1} watchdog {'on ' if enabled else 'off'} {(on if enabled else off)[-1]:8,.0f} tokens/s",
                    flush=True,
                )
    per_round = [a / b for a, b in zip(on, off, strict=True)]
    print(
        f"on / off: ratio of medians {statistics.median(on) / statistics.median(off):.3f}, per round "
        f"{', '.join(f'{r:.3f}' for r in per_round)} (median {statistics.median(per_round):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
