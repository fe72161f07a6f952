"""Warm starts on a GPU: a rank forked by a zygote that imported torch and hpkit's runtime (never CUDA) trains on the
GPU as a cold rank does. A CUDA context does not survive a fork, so the zygote must not have made one: if an import
made it, the zygote would refuse (the rank then starts cold, saying so), and this test fails on that line.

What it cannot show: whether a Slurm step's cgroup (ConstrainDevices) gives the zygote's step the node's GPUs, which
is why warm starts stay off by default for GPU jobs (docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from _gpu import TINY_MODEL, series, single_process_env, worst_relative

from hpkit.slurm.job import SlurmJob
from hpkit.slurm.script import zygote_command

pytestmark = pytest.mark.gpu

# What a job's zygote preloads for `python -m hpkit train`: the script's own list (hpkit.slurm.script.zygote_command).
PRELOAD = re.search(
    r"--preload=([^\s']+)",
    zygote_command(
        SlurmJob(name="w", launcher="torchrun", command=[sys.executable, "-m", "hpkit", "train"]), True
    ),
).group(1)
CONFIG = {
    "name": "warm-gpu",
    "parallelism": {"dp_shard": 1},
    "model": TINY_MODEL,
    "train": {
        "steps": 6,
        "local_batch_size": 4,
        "seed": 7,
        "mixed_precision": "fp32",
        "tensorboard": False,
        "metrics_file": "metrics.jsonl",
    },
}


def _env(socket: Path | None) -> dict[str, str]:
    env = single_process_env()
    env.pop("SLURM_JOB_ID", None)
    if socket is not None:
        env["HPKIT_WARM_SOCKET"] = str(socket)
    return env


def _train(workdir: Path, socket: Path | None) -> tuple[list[float], str]:
    workdir.mkdir(parents=True)
    config = {**CONFIG, "output_dir": str(workdir)}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    command = [sys.executable, "-m", "hpkit", "train", "--config", str(workdir / "config.yaml")]
    if socket is not None:
        command = [sys.executable, "-m", "hpkit.warm.client", "--", *command]
    done = subprocess.run(command, env=_env(socket), capture_output=True, text=True, timeout=600, cwd=workdir)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    records = [
        json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert "device=cuda" in done.stdout, done.stdout[-2000:]
    return series([r for r in records if "event" not in r], "loss"), done.stderr


def test_a_rank_forked_warm_trains_on_the_gpu_as_a_cold_one(tmp_path: Path) -> None:
    folder = Path(
        tempfile.mkdtemp(prefix="hpkit-warm-gpu-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    socket = folder / "z.sock"
    zygote = subprocess.Popen(
        [sys.executable, "-m", "hpkit.warm.zygote", f"--preload={PRELOAD}"],
        env=_env(socket),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert zygote.stdout is not None
        ready = zygote.stdout.readline()
        assert "ready" in ready, ready
        warm, stderr = _train(tmp_path / "warm", socket)
        assert "warm start refused" not in stderr, stderr[-3000:]
        forked = zygote.stdout.readline()
        assert "forked as process" in forked, forked  # the rank was the zygote's fork, not a cold start
        cold, _ = _train(tmp_path / "cold", None)
    finally:
        zygote.terminate()
        zygote.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
    assert len(warm) == len(cold) == CONFIG["train"]["steps"]
    # The same kernels on the same GPU; atomics in a backward may reorder sums in the last bits.
    assert worst_relative(warm, cold) < 1e-4, (warm, cold)
