"""slurm/recipes/: every spec the planner wrote renders, validates, is judged as fitting by `hpkit plan`, and keeps
its runners-up and why they lost in a comment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpkit.cli import main as cli
from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import load_document

RECIPES = Path(__file__).resolve().parents[2] / "slurm" / "recipes"
SPECS = sorted(RECIPES.glob("*.yaml"))


def test_there_are_recipes_for_each_model_and_instance() -> None:
    names = {p.name for p in SPECS}
    for model in ("llama3-8b", "llama3-70b", "mixtral-8x7b"):
        for instance in ("p4d", "p5", "p5en"):
            assert any(n.startswith(f"{model}-{instance}-") for n in names), (model, instance)
    table = (RECIPES / "README.md").read_text()
    assert all(f"[{p.name}]({p.name})" in table for p in SPECS)


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_recipe_renders_validates_and_fits(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = path.read_text()
    assert "Runners-up and why they lost:" in text and "#   #2 " in text
    spec = load_document(JobSpec, path)
    assert spec.job.instance_type and f"#SBATCH --nodes={spec.job.nodes}" in render(spec)
    stale = f"{path.name} no longer fits by the planner's models: rerun slurm/recipes/generate.py"
    assert cli(["plan", str(path), "--json"]) == 0, stale
    judged = json.loads(capsys.readouterr().out)
    assert judged["fits"] and judged["peak_gib"] <= judged["gpu_memory_gib"], stale
