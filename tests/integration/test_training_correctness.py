"""Every parallel layout trains exactly like one process: same losses and gradient norms, step by step.

Gradient norms are compared as well as losses because AdamW's update hides a wrongly reduced norm
(a per-stage or per-shard norm still gives plausible losses), and the clip threshold sits below the
norm on every step so that a wrong norm also changes the update.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import _torchrun
import pytest

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "training_layouts.py"
RTOL = 1e-5


def _layouts_module():
    spec = importlib.util.spec_from_file_location("training_layouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAYOUTS = _layouts_module().LAYOUTS
CASES = [(world, name) for world in (4, 2) for name in LAYOUTS[world]]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("layouts")
    _torchrun.run_together(
        {
            world: (
                [str(SCRIPT), str(tmp / f"world{world}.json")],
                tmp / f"tmp{world}",
                None if world == 1 else world,
            )
            for world in (1, 4, 2)
        }
    )
    merged: dict[str, dict] = {}
    for world in (1, 4, 2):
        merged.update(json.loads((tmp / f"world{world}.json").read_text()))
    return merged


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_reference_clips_every_step(results):
    ref = results["reference"]
    clip = _layouts_module().BASE["train"]["grad_clip"]
    assert len(ref["loss"]) == _layouts_module().STEPS
    assert all(n > clip for n in ref["grad_norm"]), "the clip must be active for the norm to matter"
    assert len(set(ref["loss"])) > 1, "losses should change from step to step"


@pytest.mark.parametrize(("world", "name"), CASES, ids=[n for _, n in CASES])
def test_layout_matches_single_process(results, world, name):
    ref, got = results["reference"], results[name]
    for key in ("loss", "grad_norm"):
        assert len(got[key]) == len(ref[key])
        worst = max(_rel(a, b) for a, b in zip(got[key], ref[key], strict=True))
        assert worst <= RTOL, (
            f"{name}: {key} differs from the single-process run by {worst:.2e}: {got[key]} vs {ref[key]}"
        )


# Which stages (and so which blocks: 4 blocks in 4 stages, block i in stage i) each pp rank must hold.
# Loop placement (interleaved 1F1B): stage i on pp rank i % pp. V placement (zero bubble, torch's
# ZBVZeroBubble): rank r holds stages r and 2*pp-1-r, so rank 0 has both the embeddings and the head.
LOOP = {0: [0, 2], 1: [1, 3]}
V = {0: [0, 3], 1: [1, 2]}
PLACEMENTS = {
    "pp_interleaved_1f1b": LOOP,
    "pp_fsdp_interleaved_1f1b": LOOP,
    "pp_zero_bubble": V,
    "pp_tp_zero_bubble": V,
}


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_each_rank_holds_the_stages_of_its_placement(results, name):
    expected = PLACEMENTS[name]
    held = results[name]["stages"]
    last = max(s for stages in expected.values() for s in stages)
    for rank, got in enumerate(held):
        stages = expected[got["pp_rank"]]
        assert [p["stage"] for p in got["parts"]] == stages, (rank, got)
        assert [p["layers"] for p in got["parts"]] == [[s] for s in stages], (rank, got)
        assert [p["embeddings"] for p in got["parts"]] == [s == 0 for s in stages], (rank, got)
        assert [p["head"] for p in got["parts"]] == [s == last for s in stages], (rank, got)
        # torch's schedule sends between ranks by its own map: it must agree with the parts built.
        torch_map = {int(k): v for k, v in got["torch_stage_to_rank"].items()}
        assert torch_map == {s: r for r, ss in expected.items() for s in ss}, (rank, torch_map)
    assert sorted({g["pp_rank"] for g in held}) == sorted(expected)
