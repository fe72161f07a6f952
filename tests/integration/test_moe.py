"""Mixture of experts under expert parallel trains exactly like one process, and each rank holds its experts.

One process is the reference; ep 2, ep 2 x dp_shard 2, ep 2 x tp 2 and pp 2 x ep 2 must follow it step by
step (loss, grad norm and the load-balancing loss within 1e-5) on the same global batch. The runs also
observe the layout: every rank holds exactly E / ep experts, the ones of its ep rank. A layout whose tokens
did not travel to their experts' ranks (no all-to-all, or every token sent to rank 0's experts) computes
other outputs and fails the comparison. A router biased away from one ep rank's experts leaves that rank
with no token in every step: it must still meet its peers' collectives and follow one process.

Checkpoints: an ep 2 x dp_shard 2 run's checkpoint resumes on ep 1 x dp_shard 4 and on one process (DCP
reshards the [E, ...] expert weights) and both follow the original run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _torchrun
import pytest
import yaml
from moe_layouts import BASE, EXPERTS, LAYOUTS, STEPS

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
RTOL = 1e-5
CASES = [name for world in (2, 4) for name in LAYOUTS[world]]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("moe")
    script = str(HERE / "moe_layouts.py")
    _torchrun.run_together(
        {
            world: (
                [script, str(tmp / f"world{world}.json")],
                tmp / f"tmp{world}",
                None if world == 1 else world,
            )
            for world in (1, 2, 4)
        }
    )
    merged: dict[str, dict] = {}
    for world in (1, 2, 4):
        merged.update(json.loads((tmp / f"world{world}.json").read_text()))
    return merged


def _worst(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref, strict=True))


def test_the_reference_routes_unevenly_and_learns(results):
    ref = results["reference"]
    assert len(ref["loss"]) == STEPS and len(set(ref["loss"])) > 1
    # A perfectly even router would make the balance loss exactly 1 and the load 1: these show routing.
    assert all(a > 1.0 for a in ref["aux_loss"]), ref["aux_loss"]
    assert all(load > 1.0 for load in ref["expert_load"]), ref["expert_load"]
    held = ref["experts"][0]["blocks"]
    assert sorted(held) == [str(i) for i in range(BASE["model"]["n_layers"])]
    assert all(len(sums) == EXPERTS for sums in held.values())


@pytest.mark.parametrize("name", CASES)
def test_layout_matches_single_process(results, name):
    ref, got = results["reference"], results[name]
    for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
        worst = _worst(got[key], ref[key])
        assert worst <= RTOL, (
            f"{name}: {key} differs from one process by {worst:.2e}: {got[key]} vs {ref[key]}"
        )


def test_an_ep_rank_that_receives_no_token_trains_like_one_process(results):
    """ep 2, every router biased away from ep rank 1's experts: that rank receives no row in any step's
    all-to-all, yet its backward meets its peer's collectives (without the empty branch's received rows in
    the graph the two ranks wait on each other, and the run ends after STARVED_TIMEOUT_S), and loss, grad
    norm and balance loss follow one process routed the same way."""
    ref, got = results["starved_reference"], results["ep2_starved"]
    forwards = STEPS * BASE["model"]["n_layers"]
    for rank, routed in enumerate(got["routed"]):
        assert len(routed) == forwards, (rank, routed)
        assert all(starved == 0 and total > 0 for starved, total in routed), (rank, routed)
    assert [held["ep_rank"] for held in got["experts"]] == [0, 1]
    for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
        worst = _worst(got[key], ref[key])
        assert worst <= RTOL, f"{key} differs from one process by {worst:.2e}: {got[key]} vs {ref[key]}"


@pytest.mark.parametrize("name", CASES)
def test_each_rank_holds_the_experts_of_its_ep_rank(results, name):
    ep = next(p["ep"] for w in LAYOUTS.values() for n, p in w.items() if n == name)
    per_rank = EXPERTS // ep
    reference = results["reference"]["experts"][0]["blocks"]
    ranks = results[name]["experts"]
    blocks_seen: set[str] = set()
    for rank, held in enumerate(ranks):
        start = held["ep_rank"] * per_rank
        for block, sums in held["blocks"].items():
            blocks_seen.add(block)
            # The same initial values as the reference's experts start .. start + E/ep, and no others.
            assert sums == pytest.approx(reference[block][start : start + per_rank], rel=1e-6), (rank, block)
    assert sorted({r["ep_rank"] for r in ranks}) == list(range(ep))
    assert blocks_seen == set(reference)


# Checkpoints across expert-parallel layouts.
def _spec(tmp: Path, tag: str, parallelism: dict, tasks: int, local_batch: int) -> Path:
    spec = {
        "name": f"moe-{tag}",
        "nodes": 1,
        "tasks_per_node": tasks,
        # One folder per run: runs side by side must not share the hang watchdog's boards (keyed by it).
        "output_dir": str(tmp / "out" / tag),
        "parallelism": parallelism,
        "model": BASE["model"],
        "train": {**BASE["train"], "steps": 6, "local_batch_size": local_batch},
        "checkpoint": {"dir": str(tmp / f"ckpt-{tag}"), "interval": 3, "keep": 2},
    }
    path = tmp / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _metrics(tmp: Path, tag: str) -> dict[int, dict]:
    (path,) = (tmp / "out" / tag).glob(f"moe-{tag}-*.metrics.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if "event" not in r}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-resume")
    a = _spec(tmp, "a", {"dp_shard": 2, "ep": 2}, tasks=4, local_batch=2)
    _torchrun.run(["-m", "hpkit", "train", "--config", str(a)], tmp / "tmp", 4)
    launches = {}
    for tag, parallelism, tasks, local in (
        ("b", {"dp_shard": 4, "ep": 1}, 4, 2),
        ("c", {"dp_shard": 1}, 1, 8),
    ):
        (tmp / f"ckpt-{tag}").mkdir()
        shutil.copytree(tmp / "ckpt-a" / "step-00000003", tmp / f"ckpt-{tag}" / "step-00000003")
        spec = _spec(tmp, tag, parallelism, tasks=tasks, local_batch=local)
        args = ["-m", "hpkit", "train", "--config", str(spec)]
        launches[tag] = (args, tmp / f"tmp-{tag}", None if tasks == 1 else tasks)
    # B and C each read their own copy of A's checkpoint: they run side by side.
    outs = {tag: done.stdout for tag, done in _torchrun.run_together(launches).items()}
    return tmp, outs


@pytest.mark.parametrize("tag", ["b", "c"], ids=["ep1_dp_shard4", "one_process"])
def test_an_expert_parallel_checkpoint_resumes_in_another_layout(resumed, tag):
    tmp, outs = resumed
    assert "step-00000003 at step 3" in outs[tag], outs[tag]
    original, after = _metrics(tmp, "a"), _metrics(tmp, tag)
    assert sorted(after) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
            assert after[step][key] == pytest.approx(original[step][key], rel=RTOL), (step, key)
