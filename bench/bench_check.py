"""Wall time of `hpkit check --profile login`, next to a bare `python -c pass` as the floor.

The check runs against a private local Slurm cluster (its Slurm probes talk to a live controller, as
on a login node); with a Slurm config whose controller is down they would wait out their 3 s timeout.

python3 bench/bench_check.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _cluster import ClusterError, private_cluster


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--port", default="7727")
    p.add_argument("--first-job-id", default="30000")
    args = p.parse_args()
    try:
        with private_cluster("hpkit-bench-check-", args.port, args.first_job_id) as (_, env):
            times = _time(env, args.runs)
    except ClusterError as exc:
        print(f"bench_check: {exc}", file=sys.stderr)
        return 1
    c, py = statistics.median(times["check"]), statistics.median(times["python"])
    print(
        f"check: `hpkit check --profile login` against the local cluster {c:.2f} s "
        f"(runs {[round(t, 2) for t in times['check']]}); `python -c pass` {py:.2f} s"
    )
    print(f"TIME check_login_wall_s = {c:.2f}")
    return 0


def _time(env: dict[str, str], runs: int) -> dict[str, list[float]]:
    commands = {
        "check": [sys.executable, "-m", "hpkit", "check", "--profile", "login"],
        "python": [sys.executable, "-c", "pass"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(runs):
        for name, cmd in commands.items():  # interleaved: both see the same machine load
            start = time.monotonic()
            # Exit 1 only means some check failed on this machine; the time is what is measured here.
            subprocess.run(cmd, env=env, capture_output=True, timeout=120)
            times[name].append(time.monotonic() - start)
    return times


if __name__ == "__main__":
    sys.exit(main())
