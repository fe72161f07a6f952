"""Checkpoints under SIGKILL and corruption: a resume always starts from a complete checkpoint.

Saves every step, so that kills at different moments land in different phases of a save (shards
being written, the rename, the `latest` pointer); after each kill the next run must resume from what
was complete, and in the end the losses must equal a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpkit.runtime.checkpoint import find_latest

pytestmark = pytest.mark.dist

STEPS = 40


def config(tmp_path: Path, name: str, steps: int = STEPS) -> Path:
    data = {
        "name": name,
        "output_dir": str(tmp_path / "logs"),
        "model": {"name": "debug", "n_layers": 2, "seq_len": 16},
        "train": {
            "steps": steps,
            "local_batch_size": 1,
            "lr": 0.003,
            "mixed_precision": "fp32",
            "seed": 5,
            "metrics_file": str(tmp_path / f"{name}.jsonl"),
            "tensorboard": False,
        },
        "checkpoint": {"dir": str(tmp_path / f"{name}-ckpt"), "interval": 1, "keep": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launch(cfg: Path) -> subprocess.Popen:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_PROCID")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "hpkit", "train", "--config", str(cfg)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def losses(path: Path) -> dict[int, float]:
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def test_sigkill_during_saves_never_breaks_resume(tmp_path):
    reference = launch(config(tmp_path, "reference"))
    cfg = config(tmp_path, "crashy")
    root = tmp_path / "crashy-ckpt"
    resumed_steps = []
    for delay in (0.05, 0.2, 0.45, 0.8):
        proc = launch(cfg)
        # Wait until a step has been saved (its successor is logged), then kill at a different moment
        # each time.
        seen = 0
        for line in proc.stdout:
            seen += line.startswith("step ")
            if seen == 2:
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        latest = find_latest(root)
        pointer = root / "latest"
        if pointer.exists():
            named = root / pointer.read_text().strip()
            # `latest` may lag a committed rename, but never names something incomplete.
            assert (named / ".metadata").is_file(), f"latest names an incomplete checkpoint: {named}"
        assert latest is not None and (latest / ".metadata").is_file()
        resumed_steps.append(int(latest.name.split("-")[1]))

    final = launch(cfg)
    out, _ = final.communicate(timeout=300)
    assert final.returncode == 0, out
    match = re.search(r"resumed from (\S+) at step (\d+)", out)
    assert match, out
    assert int(match.group(2)) == resumed_steps[-1]
    assert f"done steps={STEPS}" in out

    ref_out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_out
    expected, got = losses(tmp_path / "reference.jsonl"), losses(tmp_path / "crashy.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-6), f"step {step} differs after the crashes"


def test_a_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    cfg = config(tmp_path, "corrupt", steps=6)
    first = launch(cfg)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    root = tmp_path / "corrupt-ckpt"
    newest = find_latest(root)
    assert newest is not None and newest.name == "step-00000006"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # a torn write

    cfg.write_text(cfg.read_text().replace("steps: 6", "steps: 8"))
    again = launch(cfg)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert f"skipping unreadable checkpoint {newest}" in out
    assert "resumed from" in out and "step-00000005 at step 5" in out
    assert "done steps=8" in out


def test_a_full_disk_ends_the_run_with_one_line_and_no_partial_checkpoint(tmp_path):
    import resource

    cfg = config(tmp_path, "full", steps=4)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID")}

    def small_files() -> None:  # every file this process writes stops at 1 MiB: the disk is "full"
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "train", "--config", str(cfg)],
        env=env,
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpkit train: error:")]
    assert len(errors) == 1, proc.stderr
    assert "could not write checkpoint step-00000001" in errors[0]
    assert "no checkpoint is complete yet" in errors[0] and "has room" in errors[0]
    root = tmp_path / "full-ckpt"
    assert list(root.iterdir()) == [], "the failed save left files behind"
