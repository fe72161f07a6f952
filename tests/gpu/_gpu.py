"""Helpers for the CUDA tests: run `hpkit train` on one process and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
# The CUDA tests' model: small enough for seconds a run, big enough for every layout's kernels.
TINY_MODEL = {
    "name": "debug",
    "dim": 128,
    "n_layers": 4,
    "n_heads": 4,
    "ffn_dim": 256,
    "vocab_size": 512,
    "seq_len": 64,
}


def single_process_env() -> dict[str, str]:
    """This process's environment for one `hpkit train` process of this checkout: no launcher's variables (a
    rank of world 1, not a member of whatever launched pytest)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPKIT_SPEC"):
        env.pop(var, None)
    return env


def train(config: dict[str, Any], workdir: Path, *, cpu: bool, steps: int | None = None) -> list[dict]:
    """Run `hpkit train` on one process and return its metrics records (one per step)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "config.yaml"
    cfg = json.loads(json.dumps(config))
    cfg["output_dir"] = str(workdir)
    cfg.setdefault("train", {})["metrics_file"] = "metrics.jsonl"
    cfg["train"]["tensorboard"] = False
    cfg_path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    env = single_process_env()
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    args = [sys.executable, "-m", "hpkit", "train", "--config", str(cfg_path)]
    if steps is not None:
        args += ["--steps", str(steps)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900, cwd=workdir)
    assert done.returncode == 0, f"hpkit train failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    (workdir / "stdout.txt").write_text(done.stdout, encoding="utf-8")
    metrics = workdir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in records if "event" not in r]  # the start/checkpoint/end records are not steps


def series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if "step" in r and key in r]


def worst_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} steps against {len(b)}"
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
