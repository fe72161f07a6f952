"""Submission to first training step: `hpkit submit` vs a minimal hand-written sbatch + torchrun script.

Both jobs run the same program (`python -m hpkit train`, a tiny model, 2 nodes x 2 ranks) on a private local
Slurm cluster (slurm/dev/up.sh on its own port, directory and job ids), alternating which goes first;
the clock runs from just before the submitting command starts until the first `step 1 |` line shows
up in the job's output. Target: hpkit / bare <= 1.1. The cluster is stopped at the end.

    python3 bench/bench_launch.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _cluster import ClusterError, private_cluster
from hpkit.rendezvous import port_shell_expression

REPO = Path(__file__).resolve().parents[1]
FIRST_STEP = re.compile(r"^step\s+1 \|", re.MULTILINE)

CONFIG = """name: {name}
nodes: 2
tasks_per_node: 2
launcher: torchrun
output_dir: {out}
model: {{name: debug, seq_len: 64}}
train: {{steps: 3, local_batch_size: 1, tensorboard: false}}
resilience: {{max_restarts: 0}}
command: [{python}, -m, hpkit, train]
"""

BARE = """#!/bin/bash
#SBATCH --job-name=bare
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --output={out}/bare-%j.out
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
addr=$(scontrol show node "$head" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
srun torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$addr:{port}" \\
  --rdzv-id="$SLURM_JOB_ID" -m hpkit train --config {config}
"""


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", default="7717")
    p.add_argument("--first-job-id", default="20000")
    return p.parse_args()


def _first_step(path_glob: Path, pattern: str, start: float, timeout: float = 90) -> float:
    deadline = start + timeout
    while time.monotonic() < deadline:
        for path in path_glob.glob(pattern):
            if FIRST_STEP.search(path.read_text(errors="replace")):
                return time.monotonic() - start
        time.sleep(0.05)
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in path_glob.glob(pattern))
    raise TimeoutError(f"no 'step 1' line in {path_glob}/{pattern} after {timeout:.0f} s:\n{logs}")


def _drain(env: dict[str, str]) -> None:
    """Wait until no job is left, so the next one starts on an idle cluster."""
    for _ in range(600):
        out = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.1)


def _time_to_first_step(kind: str, out: Path, env: dict[str, str]) -> float:
    out.mkdir()
    config = out / "job.yaml"
    config.write_text(CONFIG.format(name=kind, out=out, python=sys.executable))
    if kind == "hpkit":
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "hpkit", "submit", str(config)], env=env,
                       cwd=out, check=True, capture_output=True)  # fmt: skip
        pattern = "hpkit-*.out"
    else:
        script = out / "bare.sbatch"
        script.write_text(BARE.format(out=out, config=config, port=port_shell_expression()))
        start = time.monotonic()
        subprocess.run(["sbatch", str(script)], env=env, cwd=out, check=True, capture_output=True)
        pattern = "bare-*.out"
    seconds = _first_step(out, pattern, start)
    # The first step is what is measured: end the job (this private cluster runs nothing else) and
    # wait until the nodes are idle again.
    subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True)
    _drain(env)
    return seconds


def main() -> int:
    args = _parse()
    times: dict[str, list[float]] = {"hpkit": [], "bare": []}
    try:
        with private_cluster("hpkit-bench-launch-", args.port, args.first_job_id) as (work, env):
            for i in range(args.rounds):
                for kind in ("hpkit", "bare") if i % 2 == 0 else ("bare", "hpkit"):
                    times[kind].append(_time_to_first_step(kind, work / f"{kind}-{i}", env))
    except ClusterError as exc:
        print(f"bench_launch: {exc}", file=sys.stderr)
        return 1
    h, b = statistics.median(times["hpkit"]), statistics.median(times["bare"])
    print(
        f"launch: submission to first step: hpkit {h:.2f} s (runs {[round(t, 2) for t in times['hpkit']]}) "
        f"vs bare sbatch+torchrun {b:.2f} s (runs {[round(t, 2) for t in times['bare']]})"
    )
    print(f"RATIO launch_hpkit_vs_bare = {h / b:.3f} (target <= 1.1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
