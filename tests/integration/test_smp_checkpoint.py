"""smp.save_checkpoint / resume_from_checkpoint (DCP), smp.save / load and a forward-only step, on 4 real
processes (tp 2 x pp 2)."""

from __future__ import annotations

import json
import os
import re

import pytest
from _torchrun import REPO, run

from hpkit.compat import SHIM_DIR

SCRIPT = REPO / "tests/integration/smp_checkpoint_script.py"


LAYOUTS = {
    "tp2xpp2": {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2},
    # No pipeline: @smp.step runs the microbatches itself and FSDP2 replicas sync on the last one.
    "tp2xdp2": {"tensor_parallel_degree": 2, "microbatches": 2, "ddp": True},
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_checkpoint_round_trip_and_losses_of_one_process(tmp_path, monkeypatch, name):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SHIM_DIR), os.environ.get("PYTHONPATH", "")]))
    layout = LAYOUTS[name]
    done = run([str(SCRIPT), str(tmp_path / "ckpt"), json.dumps(layout)], tmp_path / "tmp", nproc=4)
    # Ranks share stdout: read each record from where its prefix starts.
    decoder = json.JSONDecoder()
    records = [decoder.raw_decode(done.stdout, m.end())[0] for m in re.finditer("smp-ckpt ", done.stdout)]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], done.stdout
    for r in records:
        assert r["moved"] and r["same_model"] and r["same_opt"] and r["same_local"] and r["repeat"], r
        assert r["eval_matches"], r
        # Three steps (the third after the resume) with the losses of the same model on one process.
        assert r["losses"] == pytest.approx(r["expected"], abs=1e-5), r
        assert r["content"] == {"step": 1}
        assert r["keys"] == ["a.bias", "a.weight", "b.bias", "b.weight", "c.bias", "c.weight"]
    assert (tmp_path / "ckpt/newest").read_text().strip() == "after-1"
    assert (tmp_path / "ckpt/after-1/latest").exists()
    pp = layout.get("pipeline_parallel_degree", 1)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("local.pt_*")) == [
        f"local.pt_{s}_{t}" for s in range(pp) for t in range(2)
    ]
