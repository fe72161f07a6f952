"""Wall time of `hpkit check --profile login`, next to a bare `python -c pass` as the floor.

python3 bench/bench_check.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO / "python"), env.get("PYTHONPATH")) if x)
    commands = {
        "check": [sys.executable, "-m", "hpkit", "check", "--profile", "login"],
        "python": [sys.executable, "-c", "pass"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():  # interleaved: both see the same machine load
            start = time.monotonic()
            # Exit 1 only means some check failed on this machine; the time is what is measured here.
            subprocess.run(cmd, env=env, capture_output=True, timeout=120)
            times[name].append(time.monotonic() - start)
    c, py = statistics.median(times["check"]), statistics.median(times["python"])
    print(
        f"check: `hpkit check --profile login` {c:.2f} s (runs {[round(t, 2) for t in times['check']]}); "
        f"`python -c pass` {py:.2f} s"
    )
    print(f"TIME check_login_wall_s = {c:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
