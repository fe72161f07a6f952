from __future__ import annotations

from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.runtime.checkpoint import committed, find_latest, step_dir_name
from hpkit.runtime.train import RunConfig, load_run_config


def _complete(root: Path, step: int) -> Path:
    d = root / step_dir_name(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    return d


def test_latest_ignores_incomplete_saves(tmp_path):
    assert find_latest(tmp_path) is None
    _complete(tmp_path, 10)
    newest = _complete(tmp_path, 20)
    (tmp_path / "step-00000030.tmp").mkdir()  # a save that crashed
    (tmp_path / "step-00000040").mkdir()  # no .metadata: not complete
    assert [s for s, _ in committed(tmp_path)] == [10, 20]
    assert find_latest(tmp_path) == newest


def test_latest_pointer_wins_and_falls_back(tmp_path):
    older = _complete(tmp_path, 10)
    newest = _complete(tmp_path, 20)
    (tmp_path / "latest").write_text(older.name + "\n")
    assert find_latest(tmp_path) == older
    (tmp_path / "latest").write_text("step-00000099\n")  # points at something gone
    assert find_latest(tmp_path) == newest


def test_training_blocks_alone(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        "parallelism: {tensor_parallel_degree: 2, ddp: true}\nmodel: {name: debug}\ntrain: {steps: 3}\n"
    )
    cfg = load_run_config(path)
    assert isinstance(cfg, RunConfig)
    assert (cfg.parallelism.tp, cfg.parallelism.dp_replicate, cfg.train.steps) == (2, -1, 3)


def test_whole_job_spec(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: demo\nnodes: 2\ntasks_per_node: 2\noutput_dir: out\n"
        "parallelism: {dp_shard: 2, tp: 2}\ntrain: {steps: 4}\n"
    )
    cfg = load_run_config(path)
    assert (cfg.name, cfg.output_dir, cfg.parallelism.tp, cfg.train.steps) == ("demo", "out", 2, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train: {stpes: 3}\n", "train.stpes"),
        ("trian: {}\n", "unknown key"),
        ("- a\n", "mapping"),
    ],
)
def test_config_errors_name_the_field(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        load_run_config(path)
