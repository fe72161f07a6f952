"""hpkit.exit_settle: destroy_process_group() keeps the groups it destroys until the exit hook, so that a DDP
model freed later never destroys its group while holding the GIL (the hang it prevents is in the module's
docstring: the stacks of a hung SM_HOSTS job). In a real process, whether torch was imported before install()
(a warm start: the zygote imported it) or after (the import hook)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """\
import json, os, sys
if sys.argv[1] == "torch-first":
    import torch.distributed
from hpkit import exit_settle
exit_settle.install()
exit_settle.install()  # once is enough: the patch is not stacked
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group as imported_by_name

def runloops():
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
world, sub = dist.group.WORLD, dist.new_group([0])
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
model(torch.ones(1, 2)).sum().backward()
imported_by_name(sub)  # a subgroup: only it is kept
only_sub = [g is sub for g in exit_settle._DESTROYED]
dist.destroy_process_group()
kept = exit_settle._DESTROYED[1:]
out = {
    "patched": [f.hpkit_keeps_groups for f in (dist.destroy_process_group, imported_by_name)],
    "wrapped_once": dist.destroy_process_group.__wrapped__.__module__,
    "only_sub": only_sub,
    "kept_world": any(g is world for g in kept),
    "initialized": dist.is_initialized(),
}
del world, sub, kept
threads_before = runloops()
exit_settle._at_exit()
out |= {"left": len(exit_settle._DESTROYED), "runloops": [threads_before, runloops()]}
# A group destroyed by an exit hook that runs after this one is let go at once, not kept for a hook that has run.
dist.init_process_group("gloo", init_method="file://" + sys.argv[2] + "-2", rank=0, world_size=1)
dist.destroy_process_group()
out["kept_after_exit"] = len(exit_settle._DESTROYED)
print(json.dumps(out))
"""


@pytest.mark.parametrize("order", ["torch-first", "hook"])
def test_destroyed_groups_are_kept_until_the_exit_hook_which_destroys_them(tmp_path, order):
    env = {"PYTHONPATH": str(REPO / "python"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, order, str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["patched"] == [True, True], out  # torch.distributed's name and a name imported from it
    assert out["wrapped_once"] == "torch.distributed.distributed_c10d", out
    assert out["only_sub"] == [True] and out["kept_world"] and not out["initialized"], out
    # Each group runs two gloo threads. The subgroup, which nothing else holds once the program dropped its name,
    # keeps them until the hook and loses them there; the world group keeps its own (the DDP model holds it).
    assert out["left"] == 0, out
    assert out["runloops"] == [4, 2], out
    assert out["kept_after_exit"] == 0, out


def test_a_program_that_never_imports_torch_does_not_import_it():
    program = (
        "from hpkit import exit_settle; exit_settle.install(); import sys; print('torch' in sys.modules)"
    )
    env = {"PYTHONPATH": str(REPO / "python"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr
