"""`hpkit train` end to end: checkpoints that resume exactly, in the same layout and in another one.

Run A trains 9 steps with FSDP x TP (2 x 2) on 4 processes, saving every 3 steps (async) and keeping 2.
Its step-6 checkpoint is then what a run stopped after step 6 would have left. B resumes it in the
same layout and must reproduce A's steps 7-9 exactly; C resumes it under plain FSDP on 2 processes
(DCP reshards) and must match to floating-point reduction order.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _torchrun
import pytest
import yaml
from training_layouts import BASE

pytestmark = pytest.mark.dist

MODEL = BASE["model"]  # the layout tests' model: small enough for 4 CPU ranks, TP-divisible
SUMMARY = re.compile(
    r"^hpkit train: done steps=(\d+) final_loss=([\d.]+) tokens_per_s=(\d+) tflops_per_device=([\d.]+) "
    r"mfu=(\S+) step_ms=(\d+) world=(\d+) layout=(\S+) device=(\w+)$",
    re.M,
)


def _spec(
    tmp: Path, tag: str, parallelism: dict, steps: int = 9, tasks: int | None = None, **checkpoint
) -> Path:
    spec = {
        # A whole job spec, as the sbatch script hands it over via HPKIT_SPEC.
        "name": f"resume-{tag}",
        "nodes": 1,
        "tasks_per_node": tasks or (4 if parallelism.get("tp") else 2),
        # One folder per run: runs side by side must not share the hang watchdog's boards (keyed by it).
        "output_dir": str(tmp / "out" / tag),
        "parallelism": parallelism,
        "model": MODEL,
        "train": {
            "steps": steps,
            "local_batch_size": 4,
            "lr": 3e-3,
            "mixed_precision": "fp32",
            "tensorboard": False,
        },
        "checkpoint": {"dir": str(tmp / f"ckpt-{tag}"), "interval": 3, "keep": 2, **checkpoint},
    }
    path = tmp / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _metrics(tmp: Path, tag: str) -> dict[int, dict]:
    files = list((tmp / "out" / tag).glob(f"resume-{tag}-*.metrics.jsonl"))
    assert len(files) == 1, files
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    return {r["step"]: r for r in records if "event" not in r}  # step records, not start/checkpoint/end


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    a = _spec(tmp, "a", {"dp_shard": 2, "tp": 2}, async_save=True)
    out_a = _torchrun.run(["-m", "hpkit", "train", "--config", str(a)], tmp / "tmp", 4).stdout
    saved = tmp / "ckpt-a" / "step-00000006"
    for tag in ("b", "c"):
        (tmp / f"ckpt-{tag}").mkdir()
        shutil.copytree(saved, tmp / f"ckpt-{tag}" / saved.name)
    # B finds the checkpoint through `latest`; C has none and must fall back to the newest complete one,
    # ignoring a half-written save.
    (tmp / "ckpt-b" / "latest").write_text(saved.name + "\n")
    (tmp / "ckpt-c" / "step-00000008.tmp").mkdir()
    b = _spec(tmp, "b", {"dp_shard": 2, "tp": 2})
    c = _spec(tmp, "c", {"dp_shard": 2})
    # D: A's two checkpoints, the newest with 64 bytes flipped inside one shard.
    shutil.copytree(tmp / "ckpt-a", tmp / "ckpt-d")
    _flip(tmp / "ckpt-d" / "step-00000009" / "__3_0.distcp")
    d = _spec(tmp, "d", {"dp_shard": 2, "tp": 2})
    # E: A's checkpoints intact, but "node 2" (the second torchrun agent, ranks 2 and 3) sees an empty
    # __3_0.distcp in step 9 through its own mount namespace, as a node with a stale or broken mount of
    # the shared filesystem would. Ranks 0 and 1 see the good file.
    shutil.copytree(tmp / "ckpt-a", tmp / "ckpt-e")
    e = _spec(tmp, "e", {"dp_shard": 2, "tp": 2})
    hidden = tmp / "ckpt-e" / "step-00000009" / "__3_0.distcp"
    # B to E each read their own copy of A's checkpoints and write their own metrics: they run side by side.
    train = ["-m", "hpkit", "train", "--config"]
    with ThreadPoolExecutor(2) as pool:
        two_nodes = pool.submit(
            _torchrun.run_two_agents, [*train, str(e)], tmp / "tmp-e", 2, second_node_hides=hidden
        )
        outs = _torchrun.run_together(
            {
                "b": ([*train, str(b)], tmp / "tmp-b", 4),
                "c": ([*train, str(c)], tmp / "tmp-c", 2),
                "d": ([*train, str(d)], tmp / "tmp-d", 4),
            }
        )
        out_e = two_nodes.result().stdout
    return tmp, {"a": out_a, **{tag: done.stdout for tag, done in outs.items()}, "e": out_e}


def _flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def test_summary_line_and_metrics(runs):
    tmp, out = runs
    m = SUMMARY.search(out["a"])
    assert m, out["a"]
    steps, loss, tps, world, layout = int(m[1]), float(m[2]), int(m[3]), int(m[7]), m[8]
    metrics = _metrics(tmp, "a")
    assert steps == 9 and world == 4 and layout == "dp_shard:2,tp:2" and m[9] == "cpu"
    assert sorted(metrics) == list(range(1, 10))
    assert loss == pytest.approx(metrics[9]["loss"], abs=1e-4)
    assert tps > 0 and m[5] == "n/a"  # no peak FLOP/s is known for a CPU
    assert all(r["tokens_per_s"] > 0 and r["memory_max_rss_gib"] > 0 for r in metrics.values())
    assert out["a"].count("hpkit train: done") == 1, "only rank 0 prints"


def test_keeps_last_k_and_latest(runs):
    tmp, _ = runs
    ckpt = tmp / "ckpt-a"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-00000006", "step-00000009"]
    assert (ckpt / "latest").read_text().strip() == "step-00000009"


def test_resume_same_layout_is_exact(runs):
    tmp, out = runs
    assert "resumed from" in out["b"] and "step-00000006 at step 6" in out["b"]
    a, b = _metrics(tmp, "a"), _metrics(tmp, "b")
    assert sorted(b) == [7, 8, 9]
    for step in (7, 8, 9):
        assert b[step]["loss"] == a[step]["loss"], step
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step


def test_resume_into_plain_fsdp_on_two_processes(runs):
    tmp, out = runs
    assert "step-00000006 at step 6" in out["c"]
    assert not (tmp / "ckpt-c" / "step-00000008.tmp").exists(), "a half-written save is cleaned up"
    a, c = _metrics(tmp, "a"), _metrics(tmp, "c")
    assert sorted(c) == [7, 8, 9]
    for step in (7, 8, 9):
        for key in ("loss", "grad_norm"):
            assert c[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)


def _skips(out: str) -> list[str]:
    return [line for line in out.splitlines() if "skipping checkpoint" in line]


def test_flipped_bytes_in_a_shard_are_found_and_that_checkpoint_is_skipped(runs):
    tmp, out = runs
    skips = _skips(out["d"])
    assert len(skips) == 1, out["d"]
    assert re.search(r"step-00000009: __3_0\.distcp: CRC-32C \w{8}, the record says \w{8}", skips[0]), skips[
        0
    ]
    assert "step-00000006 at step 6" in out["d"]
    a, d = _metrics(tmp, "a"), _metrics(tmp, "d")
    assert sorted(d) == [7, 8, 9]
    for step in (7, 8, 9):
        assert d[step]["loss"] == a[step]["loss"], step


def test_a_problem_only_some_ranks_see_makes_every_rank_skip_that_checkpoint(runs):
    """Only node 2's ranks see the bad file: their verdict must send all four ranks back to step 6.

    Were the verdict not agreed, ranks 0 and 1 would start loading step 9 while 2 and 3 skipped it,
    and the run would hang in the load's collectives (the launch's timeout fails the test)."""
    tmp, out = runs
    skips = _skips(out["e"])
    assert len(skips) == 1, out["e"]
    assert re.search(
        r"step-00000009: __3_0\.distcp: 0 bytes, the record says \d+ \(seen by rank 2,3 of 4\)", skips[0]
    ), skips[0]
    assert "step-00000006 at step 6" in out["e"]
    a, e = _metrics(tmp, "a"), _metrics(tmp, "e")
    assert sorted(e) == [7, 8, 9]
    for step in (7, 8, 9):
        assert e[step]["loss"] == a[step]["loss"], step


# Pipeline checkpoints: P trains 9 steps under pp 2 interleaved 1F1B (2 stages per rank, loop placement),
# saving every 3 steps. Q resumes P's step 3 on one process (pp 1: one part holding every block) and
# trains on to step 9; R resumes Q's step 6 under pp 2 zero bubble (V placement). Both must follow P.
INTERLEAVED = {
    "pp": 2,
    "dp_shard": 1,
    "microbatches": 4,
    "pp_schedule": "interleaved_1f1b",
    "stages_per_rank": 2,
}
ZERO_BUBBLE = {"pp": 2, "dp_shard": 1, "microbatches": 4, "pp_schedule": "zero_bubble", "stages_per_rank": 2}


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-resume")
    p = _spec(tmp, "p", INTERLEAVED, keep=3)
    out_p = _torchrun.run(["-m", "hpkit", "train", "--config", str(p)], tmp / "tmp", 2).stdout
    (tmp / "ckpt-q").mkdir()
    shutil.copytree(tmp / "ckpt-p" / "step-00000003", tmp / "ckpt-q" / "step-00000003")
    q = _spec(tmp, "q", {"dp_shard": 1}, tasks=1, keep=3)
    out_q = _torchrun.run(["-m", "hpkit", "train", "--config", str(q)], tmp / "tmp", None).stdout
    (tmp / "ckpt-r").mkdir()
    shutil.copytree(tmp / "ckpt-q" / "step-00000006", tmp / "ckpt-r" / "step-00000006")
    r = _spec(tmp, "r", ZERO_BUBBLE)
    out_r = _torchrun.run(["-m", "hpkit", "train", "--config", str(r)], tmp / "tmp", 2).stdout
    return tmp, {"p": out_p, "q": out_q, "r": out_r}


def test_pipeline_checkpoints_keep_the_whole_models_names(pp_runs):
    import torch.distributed.checkpoint as dcp

    tmp, _ = pp_runs

    def keys(path: Path) -> set[str]:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)

    interleaved, single = keys(tmp / "ckpt-p" / "step-00000006"), keys(tmp / "ckpt-q" / "step-00000006")
    assert interleaved == single
    assert {f"model.layers.{i}.attention.wq.weight" for i in range(MODEL["n_layers"])} <= single
    assert {"model.tok_embeddings.weight", "model.output.weight"} <= single


@pytest.mark.parametrize(("tag", "saved", "steps"), [("q", 3, range(4, 10)), ("r", 6, range(7, 10))])
def test_resume_across_pipeline_layouts(pp_runs, tag, saved, steps):
    tmp, out = pp_runs
    assert f"step-{saved:08d} at step {saved}" in out[tag], out[tag]
    p, resumed = _metrics(tmp, "p"), _metrics(tmp, tag)
    assert sorted(resumed) == list(steps)
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(p[step][key], rel=1e-5), (step, key)
