"""Submission to first training step inside the CPU image (container.runtime: oci) vs outside it.

The same job spec (`hpkit train`, a tiny model, 2 nodes x 2 ranks, torchrun) is submitted with `hpkit submit`
to a private local Slurm cluster (slurm/dev/up.sh: its own port, directory and job ids, with oci.conf for
runc), once as it is and once with a `container: {runtime: oci, image: BUNDLE}` block, alternating which goes
first, after one untimed run of each side (the image's files are read from disk the first time, while the
host's torch is in the page cache already on a machine that runs tests). The clock runs from just before `hpkit submit` starts until the first `step 1 |` line shows up in the
job's output, so the container side pays for writing the job's bundle, runc and the image's start-up check
(warn, once per node). Target: container / host <= 1.15. Not in `make bench` (it needs the image):

    make image-cpu IMAGE_BASE=hpkit-base:bookworm && .venv/bin/hpkit image export --oci /tmp/hpkit-cpu
    python3 bench/bench_container_launch.py --bundle /tmp/hpkit-cpu [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _cluster import ClusterError, private_cluster
from bench_launch import _drain, _first_step
from hpkit.oci import bundle_problem

SPEC = """name: {name}
nodes: 2
tasks_per_node: 2
output_dir: {out}
env: {{AWS_EC2_METADATA_DISABLED: "true"}}
model: {{name: debug, seq_len: 64}}
train: {{steps: 3, local_batch_size: 1, tensorboard: false}}
resilience: {{max_restarts: 0}}
command: [hpkit, train]
"""

CONTAINER = """container:
  runtime: oci
  image: {bundle}
  mounts: ["{out}:{out}"]
"""


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--bundle", required=True, help="the CPU image as an OCI bundle (hpkit image export --oci)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each side first (default: 1)")
    p.add_argument("--port", default="7737")
    p.add_argument("--first-job-id", default="22000")
    return p.parse_args()


def _time_to_first_step(side: str, out: Path, env: dict[str, str], bundle: Path) -> float:
    out.mkdir()
    spec = out / "job.yaml"
    text = SPEC.format(name=side, out=out)
    if side == "container":
        text += CONTAINER.format(bundle=bundle, out=out)
    spec.write_text(text)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "hpkit", "submit", str(spec)], env=env,
                   cwd=out, check=True, capture_output=True)  # fmt: skip
    seconds = _first_step(out, f"{side}-*.out", start)
    # The first step is what is measured: end the job and wait until the nodes are idle again.
    subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True)
    _drain(env)
    return seconds


def main() -> int:
    args = _parse()
    bundle = Path(args.bundle).resolve()
    if problem := bundle_problem(bundle):
        print(f"bench_container_launch: --bundle: {problem}", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {"container": [], "host": []}
    try:
        with private_cluster("hpkit-bench-oci-", args.port, args.first_job_id) as (work, env):
            for i in range(args.warmup):
                for side in ("container", "host"):
                    seconds = _time_to_first_step(side, work / f"{side}-warmup-{i}", env, bundle)
                    print(f"warm-up {side:9s} {seconds:6.2f} s (not counted)", flush=True)
            for i in range(args.rounds):
                for side in ("container", "host") if i % 2 == 0 else ("host", "container"):
                    times[side].append(_time_to_first_step(side, work / f"{side}-{i}", env, bundle))
                    print(f"round {i + 1} {side:9s} {times[side][-1]:6.2f} s", flush=True)
    except ClusterError as exc:
        print(f"bench_container_launch: {exc}", file=sys.stderr)
        return 1
    c, h = statistics.median(times["container"]), statistics.median(times["host"])
    print(
        f"container launch: submission to first step: in the image (oci) {c:.2f} s "
        f"(runs {[round(t, 2) for t in times['container']]}) vs outside {h:.2f} s "
        f"(runs {[round(t, 2) for t in times['host']]})"
    )
    print(f"RATIO container_launch_oci_vs_host = {c / h:.3f} (target <= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
