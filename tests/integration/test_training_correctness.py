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
    merged: dict[str, dict] = {}
    for world in (1, 4, 2):
        out = tmp / f"world{world}.json"
        _torchrun.run([str(SCRIPT), str(out)], tmp / f"tmp{world}", None if world == 1 else world)
        merged.update(json.loads(out.read_text()))
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
