"""MemoryCheckpointer over a real gloo world of 3 processes, each rank on its own (emulated) node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

_RANK = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from hpkit.runtime.config import MemoryCheckpointSpec
from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer

root, rank, world = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{root.parent / 'store'}", rank=rank, world_size=world)

def state(fill):
    # Entries every rank holds alike (as AdamW's per-parameter step counters and the trainer's step), which
    # DCP writes once, in one rank's file, and each rank's own entry (as an FSDP shard).
    s = {f"shared{i}": torch.full((1024,), float(fill)) for i in range(9)}
    s[f"own{rank}"] = torch.full((4096,), float(fill + rank))
    return s

spec = MemoryCheckpointSpec(every=1)
saver = MemoryCheckpointer(spec, root, f"n{rank}", log=lambda line: None)
saver.save(5, state(5))
saver.wait()
saver.close(completed=False)

# Rank 0 and rank 2 (which held rank 0's copy) both on new nodes: rank 0's state is lost, and rank 0's line names
# the rank and the node it was saved on (that map comes from the one node left holding the step).
lines = []
lost = MemoryCheckpointer(spec, root, f"spare{rank}" if rank in (0, 2) else f"n{rank}", log=lines.append)
lost_step = lost.restore(state(0), newer_than=None)
lost.close(completed=False)

# Rank 2 comes back on a new node, which holds nothing: what it reads comes from its peers.
restorer = MemoryCheckpointer(spec, root, "spare" if rank == 2 else f"n{rank}", log=lambda line: None)
loaded = state(0)
step = restorer.restore(loaded, newer_than=None)
values = sorted({float(v[0]) for v in loaded.values()})
received = sorted(p.name for p in (root / "spare").glob("step-*/*.distcp")) if rank == 2 else []
restorer.close(completed=False)

print(json.dumps({"rank": rank, "step": step, "values": values, "received": received, "lost_step": lost_step, "lines": lines}))
dist.destroy_process_group()
"""


def test_a_rank_on_a_new_node_receives_its_own_state_and_rank_0s_not_every_ranks(tmp_path, repo):
    """Entries every rank holds alike go to rank 0's file, so a rank on a new node pulls at most its own file and
    rank 0's, not (as DCP's default balancing of those entries over all ranks' files has it) every rank's file:
    the bytes a peer restore moves grow with a rank's state, not with the job's."""
    root = tmp_path / "mem" / "run"
    world = 3
    root.parent.mkdir(parents=True)  # the ranks' rendezvous file goes there
    env = dict(os.environ, PYTHONPATH=str(repo / "python"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(root), str(rank), str(world)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["step"] == 5
        assert r["values"] == sorted({5.0, 5.0 + r["rank"]})  # every entry as saved
    assert results[2]["received"] == ["__0_0.distcp", "__2_0.distcp"]
    assert [r["lost_step"] for r in results] == [None, None, None]
    (line,) = results[0]["lines"]
    assert "in-memory checkpoint step 5 is incomplete: the state of rank(s) 0 was held only on n0" in line, (
        line
    )
