"""collectives.measure on a subgroup: each collective gives the right data when the group's first
member is not global rank 0 (broadcast and reduce name their root by global rank), while a rank outside
the group goes on with its own work."""

from __future__ import annotations

import json
from pathlib import Path

from _torchrun import run

SCRIPT = """
import json, torch, torch.distributed as dist
from hpkit.netbench.collectives import DEFAULT_OPS, SweepConfig, measure
from hpkit.runtime.env import distributed

with distributed() as d:
    group = dist.new_group([1, 2])
    if d.launch.rank in (1, 2):
        cfg = SweepConfig((*DEFAULT_OPS, "reduce"), (4096,), iters=2, warmup=1, dtype="float", check=True)
        rows = measure(cfg, torch.device("cpu"), "gloo", group=group)
        if d.launch.rank == 1:
            print("ROWS " + json.dumps([[r.op, r.ranks, r.wrong] for r in rows]), flush=True)
        dist.destroy_process_group(group)
"""


def test_measure_on_a_subgroup_of_ranks_1_and_2(tmp_path: Path) -> None:
    script = tmp_path / "subgroup.py"
    script.write_text(SCRIPT)
    done = run([str(script)], tmp_path / "tmp", nproc=3, timeout=300)
    line = next(line for line in done.stdout.splitlines() if line.startswith("ROWS "))
    rows = json.loads(line[len("ROWS ") :])
    assert {op for op, _, _ in rows} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
        "reduce",
    }
    assert all(ranks == 2 and wrong == 0 for _, ranks, wrong in rows), rows
