"""What the hang watchdog costs a training step: `hpkit train` with `resilience.hang.enabled` on and off, side by
side, alternating (2 ranks, torchrun, gloo, the debug Llama at dim 256, 4 blocks, seq 256, local batch 4).

The watchdog is a thread that wakes once a second to write one small file and read the others; the train loop
only sets three attributes per step. Target: on / off >= 0.99 in tokens/s.

    python3 bench/bench_hang_watchdog.py [--rounds 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from _sides import REPO, alternate, ratio_line, run_env

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
    env = run_env(out)
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
    results = alternate(
        {"on": lambda out: run(True, args.steps, out), "off": lambda out: run(False, args.steps, out)},
        args.rounds,
    )
    print(ratio_line("on", results["on"], "off", results["off"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
