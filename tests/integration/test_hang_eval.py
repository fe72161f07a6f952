"""The hang watchdog in a real `hpkit train` (torchrun, gloo, 2 ranks) whose rank 1 is stuck in Python as a
validation begins (HPKIT_FAULT hang_eval): rank 0 waits in the validation's collectives. A validation is
phase "eval", allowed its own length (here min_s: 2 batches of steps well under a second); then rank 1 is named
and the run ends, instead of waiting out the collective timeout as it did when a validation was judged as a
save (which holds the clock for ever)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import yaml
from _torchrun import REPO, torch_env, torchrun_command

MIN_S = 5.0
TIMEOUT_S = 120  # the collective timeout: the old behaviour's only end


def _config(tmp: Path) -> Path:
    cfg = {
        "name": "eval-hang",
        "output_dir": str(tmp / "out"),
        "model": {"name": "debug", "dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "seq_len": 32},
        "parallelism": {"dp_shard": 2},
        "train": {"steps": 1000, "local_batch_size": 2, "log_every": 1, "tensorboard": False},
        "eval": {"every": 4, "steps": 2, "data": {"kind": "synthetic"}},
        "resilience": {
            "hang": {"min_s": MIN_S, "factor": 10, "start_s": 120},
            "collective_timeout_s": TIMEOUT_S,
        },
    }
    path = tmp / "eval-hang.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_rank_stuck_in_a_validation_is_named_before_the_collective_timeout(tmp_path):
    fault_log = tmp_path / "faults.jsonl"
    env = {
        **torch_env(tmp_path / "tmp"),
        "HPKIT_FAULT": "hang_eval:rank=1,step=8",
        "HPKIT_FAULT_LOG": str(fault_log),
    }
    cmd = torchrun_command(
        ["-m", "hpkit", "train", "--config", str(_config(tmp_path))], 2, env, "--standalone"
    )
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S + 240,
    )
    log = proc.stdout
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()] if fault_log.exists() else []
    assert [(f["kind"], f["rank"], f["step"]) for f in fired] == [("hang_eval", 1, 8)], log[-5000:]
    verdicts = list((tmp_path / "out" / "hangs").glob("*-step*/verdict.json"))
    assert len(verdicts) == 1, f"no verdict after {time.monotonic() - started:.0f} s:\n{log[-5000:]}"
    verdict = json.loads(verdicts[0].read_text())
    assert verdict["culprits"] == [1], verdict
    # Named well before the collective timeout: the validation was judged by its own length.
    detected = verdicts[0].stat().st_mtime - fired[0]["at"]
    assert detected < TIMEOUT_S / 2, f"named {detected:.0f} s after the fault"
    assert proc.returncode != 0
