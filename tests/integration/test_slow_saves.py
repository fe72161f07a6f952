"""Every checkpoint save is judged as a save by the hang watchdog, the final one included.

A real `hpkit train` run (torchrun, gloo, 2 ranks) whose saves are all slowed (HPKIT_FAULT slow_save) well
past its hang threshold (min_s 2 s; the steps take milliseconds): the in-loop save of step 2 and the final
save of step 3. Judged as steps, either would be called a hang (exit 75, step-N.tmp left uncommitted, and the
job script would restart into the same save); judged as saves, the run commits both and exits 0.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from _torchrun import REPO, torch_env, torchrun_command

pytestmark = pytest.mark.dist

MIN_S = 2.0  # the smallest the spec allows; the hang threshold is max(min_s, factor x median step)
SLOW_S = 5.0  # each save's delay: well past the threshold and the watchdog's beat interval (1 s)


def test_slow_saves_final_included_are_not_called_a_hang(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = {
        "name": "slow-saves",
        "output_dir": str(tmp_path / "out"),
        "model": {"name": "debug", "dim": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 128, "seq_len": 16},
        "parallelism": {"dp_shard": 2},
        "train": {"steps": 3, "local_batch_size": 1, "log_every": 1, "tensorboard": False},
        # interval 2 of 3 steps: one in-loop save (step 2), then the final save (step 3).
        "checkpoint": {"dir": str(ckpt), "interval": 2, "keep": 2},
        "resilience": {"hang": {"min_s": MIN_S, "factor": 2, "start_s": 60}, "collective_timeout_s": 120},
    }
    config = tmp_path / "slow-saves.yaml"
    config.write_text(yaml.safe_dump(cfg))
    fault_log = tmp_path / "faults.jsonl"
    env = {
        **torch_env(tmp_path / "tmp"),
        "HPKIT_FAULT": f"slow_save:seconds={SLOW_S:g}",
        "HPKIT_FAULT_LOG": str(fault_log),
    }
    done = subprocess.run(
        torchrun_command(["-m", "hpkit", "train", "--config", str(config)], 2, env, "--standalone"),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    assert "hpkit: hang" not in log, log[-5000:]
    assert not list((tmp_path / "out" / "hangs").glob("*-step*")), log[-3000:]
    # Both saves were slowed on both ranks, the final one too.
    fired = sorted((r["step"], r["rank"]) for r in map(json.loads, fault_log.read_text().splitlines()))
    assert fired == [(2, 0), (2, 1), (3, 0), (3, 1)], fired
    # Both committed (their commit records), nothing left half-written.
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-00000002", "step-00000003"]
    assert all((ckpt / name / "hpkit-commit.json").is_file() for name in ("step-00000002", "step-00000003"))
    assert (ckpt / "latest").read_text().strip() == "step-00000003"
    assert "done steps=3" in done.stdout, log[-3000:]
