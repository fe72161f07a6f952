"""How long the planner's memory model takes: the 16 predictions of a 70B on 128 GPUs (tp x pp over 1-8 each), on
the login node's CPU. A speed claim, so it lives here rather than in a unit test (tests/unit/test_plan_memory.py
checks only that no torch is imported).

    python3 bench/bench_plan_predict.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from hpkit.plan import Layout, predict, shape_named

    shape = shape_named("70B", 8192)
    layouts = [
        Layout(dp_shard=128 // tp // pp, tp=tp, pp=pp, microbatches=8, local_batch_size=8)
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4, 8)
    ]
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for layout in layouts:
            predict(shape, layout, "p5.48xlarge")
        times.append(time.perf_counter() - start)
    print(f"TIME plan_predict_16_layouts_70b = {statistics.median(times):.4f} s (median of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
