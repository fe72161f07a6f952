"""slurmctld's RPCs while waiting on 1, 10 and 50 jobs: `hpkit wait` beside one call per job, side by side.

Both sides run on one private local cluster (slurm/dev/up.sh on its own port, directory and job ids) against
the same cheap `sleep` jobs (4 run, the rest wait: nothing changes during a window), alternating which goes
first. Each side polls for the same wall-clock window on the same schedule (hpkit.slurm.poll_interval: every
second for 10 s, then every 2 s, ...):

- hpkit: the real CLI, `python -m hpkit wait JOBS --timeout WINDOW` (one `squeue --json` a poll for all jobs);
- one call per job: `scontrol show job -o ID` for each job at each poll, as a script that watches each job on
  its own does.

The controller's own count is the measure: `sdiag`'s RPC table by message type before and after the window
(the query types; sdiag's own REQUEST_STATS_INFO and the daemons' traffic left out), and the table by user
(every RPC of the user that ran the clients, sdiag's own left out).

    python3 bench/bench_slurm_polling.py [--jobs 1,10,50] [--window 20]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "integration")]

from test_slurm_polling import QUERY_RPCS  # noqa: E402  (the test's rule of which RPCs a job query sends)

from _cluster import ClusterError, private_cluster  # noqa: E402
from hpkit.slurm import poll_interval  # noqa: E402

SDIAG_RPC = "REQUEST_STATS_INFO"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="1,10,50", help="numbers of jobs to wait on (default 1,10,50)")
    p.add_argument("--window", type=float, default=20.0, help="seconds each side polls (default 20)")
    p.add_argument("--port", default="7757")
    p.add_argument("--first-job-id", default="26000")
    return p.parse_args()


def sdiag(env: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    """(count by message type, count by user) since slurmctld started."""
    out = subprocess.run(["sdiag"], env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    by_type_text = out.split("statistics by message type", 1)[1].split("statistics by user", 1)[0]
    by_user_text = out.split("statistics by user", 1)[1].split("Pending RPC", 1)[0]
    row = re.compile(r"^\s*(\S+)\s+\(\s*\d+\)\s+count:(\d+)", re.M)
    return (
        {m.group(1): int(m.group(2)) for m in row.finditer(by_type_text)},
        {m.group(1): int(m.group(2)) for m in row.finditer(by_user_text)},
    )


def measure(env: dict[str, str], run) -> tuple[int, int, dict[str, int]]:
    """(query RPCs, all RPCs of the users, RPCs by query type) that `run()` cost the controller."""
    types0, users0 = sdiag(env)
    run()
    types1, users1 = sdiag(env)
    delta = {k: types1.get(k, 0) - types0.get(k, 0) for k in types1}
    queries = {k: delta[k] for k in QUERY_RPCS if delta.get(k)}
    # The two sdiag calls between the snapshots count one REQUEST_STATS_INFO (the first is before `before`).
    users = sum(users1.values()) - sum(users0.values()) - delta.get(SDIAG_RPC, 0)
    return sum(queries.values()), users, queries


def hpkit_wait(env: dict[str, str], jobs: list[str], window: float) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hpkit", "wait", *jobs, "--backend", "cli", "--timeout", str(window)],
        env=env,
        capture_output=True,
        text=True,
        timeout=window + 120,
    )
    if "still running after" not in done.stderr:  # the jobs outlive the window: the wait gives up on time
        raise RuntimeError(f"hpkit wait: {done.stderr.strip()[-500:]}")


def per_job(env: dict[str, str], jobs: list[str], window: float) -> None:
    start = time.monotonic()
    while True:
        for job in jobs:
            subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, timeout=60)
        elapsed = time.monotonic() - start
        if elapsed > window:
            return
        time.sleep(poll_interval(elapsed))


def submit(env: dict[str, str], work: Path, count: int) -> list[str]:
    jobs = []
    for _ in range(count):
        done = subprocess.run(
            ["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 3600"],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        jobs.append(done.stdout.strip().split(";")[0])
    return jobs


def main() -> int:
    args = _parse()
    counts = sorted(int(n) for n in args.jobs.split(","))
    rows: dict[int, dict[str, tuple[int, int, dict[str, int]]]] = {}
    try:
        with private_cluster("hpkit-bench-polling-", args.port, args.first_job_id) as (work, env):
            jobs = submit(env, work, max(counts))
            time.sleep(2)  # let the scheduler start the first 4, so no state changes inside a window
            for i, n in enumerate(counts):
                sides = {
                    "hpkit": lambda n=n: hpkit_wait(env, jobs[:n], args.window),
                    "per_job": lambda n=n: per_job(env, jobs[:n], args.window),
                }
                order = ("hpkit", "per_job") if i % 2 == 0 else ("per_job", "hpkit")
                rows[n] = {side: measure(env, sides[side]) for side in order}
            # End the jobs while slurmd runs: stopping the cluster alone leaves running batch shells behind.
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True)
            for _ in range(120):
                if not subprocess.run(
                    ["squeue", "-h"], env=env, capture_output=True, text=True
                ).stdout.strip():
                    break
                time.sleep(0.5)
    except ClusterError as exc:
        print(f"bench_slurm_polling: {exc}", file=sys.stderr)
        return 1
    print(
        f"slurmctld RPCs over a {args.window:.0f} s window (query RPCs; all of the user's RPCs in brackets)"
    )
    print(f"{'jobs':>5} {'hpkit wait':>16} {'one call per job':>18} {'per job / hpkit':>16}")
    for n in counts:
        (hq, hu, _), (pq, pu, _) = rows[n]["hpkit"], rows[n]["per_job"]
        print(f"{n:>5} {hq:>8} [{hu:>5}] {pq:>10} [{pu:>5}] {pq / max(hq, 1):>16.1f}")
    top = max(counts)
    # Polls made: hpkit's one squeue --json each; per job, each job's REQUEST_JOB_INFO_SINGLE once a poll.
    hpkit_polls = rows[top]["hpkit"][2].get("REQUEST_JOB_INFO", 0)
    per_job_polls = rows[top]["per_job"][2].get("REQUEST_JOB_INFO_SINGLE", 0) / top
    print(
        f"per poll at {top} jobs: hpkit {rows[top]['hpkit'][0] / max(hpkit_polls, 1):.1f} RPCs ({hpkit_polls} polls), "
        f"one call per job {rows[top]['per_job'][0] / max(per_job_polls, 1):.1f} RPCs ({per_job_polls:.0f} polls)"
    )
    print(
        f"by message type at {top} jobs: hpkit {rows[top]['hpkit'][2]}, one call per job {rows[top]['per_job'][2]}"
    )
    low, high = rows[min(counts)]["hpkit"][0], rows[top]["hpkit"][0]
    print(
        f"RATIO slurm_polling hpkit_{top}_jobs/hpkit_{min(counts)}_job = {high / max(low, 1):.2f} (target <= 1.1)"
    )
    print(
        f"RATIO slurm_polling per_job/hpkit_at_{top}_jobs = {rows[top]['per_job'][0] / max(high, 1):.1f} "
        "(hpkit's saving)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
