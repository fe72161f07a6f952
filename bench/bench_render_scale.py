"""Render and submit preparation of a 2,048-node spec next to a 2-node one: the cost must not grow with nodes.

Each side runs what `hpkit submit` does before sbatch (hpkit.jobs.submission.prepare: read and check
the spec, write its snapshot and the rendered script), in one process, alternating in batches so that
both see the same machine load; the ratio of the medians is printed. The script reads the node list
at run time (scontrol in the batch shell), so nothing in it is per node.

python3 bench/bench_render_scale.py [--batches 15 --per-batch 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from hpkit.jobs.submission import prepare  # this checkout's hpkit

LIMIT = 1.1


def spec(nodes: int, out: Path) -> dict:
    # A realistic large job: GPUs, a container, SageMaker variables, every Slurm option.
    return {
        "name": f"scale-{nodes}",
        "nodes": nodes,
        "gpus_per_node": 8,
        "partition": "p5",
        "launcher": "torchrun",
        "output_dir": str(out),
        "exclude": "p5-[0001-0004]",
        "constraint": "h100&efa",
        "mail_type": ["END", "FAIL"],
        "sbatch_options": ["--comment=scale"],
        "srun_options": ["--cpu-bind=none"],
        "container": {"image": "/fsx/images/hpkit.sqsh", "mounts": ["/fsx:/fsx"]},
        "sagemaker_env": {"channels": {"train": "/fsx/data"}},
        "parallelism": {"dp_shard": -1, "tp": 8},
        "checkpoint": {"dir": "/fsx/ckpt/%j", "interval": 100},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=15)
    p.add_argument("--per-batch", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpkit-bench-scale-") as tmp:
        root = Path(tmp)
        files = {}
        for nodes in (2, 2048):
            path = root / f"scale-{nodes}.yaml"
            path.write_text(yaml.safe_dump(spec(nodes, root / f"out-{nodes}")))
            files[nodes] = path
        scripts = {n: prepare(f).script.read_text() for n, f in files.items()}  # warm-up
        assert "--nodes=2048" in scripts[2048] and "--nnodes=2048" in scripts[2048]
        times: dict[int, list[float]] = {2: [], 2048: []}
        for _ in range(args.batches):
            for nodes, path in files.items():  # interleaved: both sides see the same load
                start = time.perf_counter()
                for _ in range(args.per_batch):
                    prepare(path)
                times[nodes].append((time.perf_counter() - start) / args.per_batch)
    small, large = statistics.median(times[2]), statistics.median(times[2048])
    ratio = large / small
    print(
        f"render_scale: render + submit preparation, 2 nodes {small * 1e3:.2f} ms, 2,048 nodes "
        f"{large * 1e3:.2f} ms per spec (median of {args.batches} batches of {args.per_batch}); "
        f"script sizes {len(scripts[2])} and {len(scripts[2048])} bytes"
    )
    print(f"RATIO render_scale_2048_over_2 = {ratio:.3f} (limit {LIMIT})")
    return 0 if ratio <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
