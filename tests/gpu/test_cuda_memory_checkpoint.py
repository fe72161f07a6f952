"""In-memory checkpoints on a GPU (`checkpoint.memory`): the state of a CUDA run is staged through pinned host memory
(the stager's CUDA path, which no CPU run takes) into node memory every step, and a run stopped part-way resumes
from there, with no `checkpoint.dir` to fall back to, at the step it stopped, with the losses of a run that never
stopped.

Without the in-memory tier the second run would start again at step 1 (nothing else holds its state), and with a
staging copy that raced the optimizer (a non-blocking copy read after the next step changed the weights) the resumed
losses would part from the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from _gpu import TINY_MODEL, single_process_env, worst_relative

from hpkit.runtime.checkpoints.memory_layout import COMPLETE

pytestmark = pytest.mark.gpu

STEPS = 300  # long enough that the stop lands well before the end, at a few milliseconds a step
STOP_AFTER = 3  # the stop is sent once this step's copy is complete
CONFIG = {
    "name": "memory-gpu",
    "parallelism": {"dp_shard": 1},
    "model": TINY_MODEL,
    "train": {
        "steps": STEPS,
        "local_batch_size": 4,
        "lr": 3e-3,
        "seed": 7,
        "mixed_precision": "fp32",
        "tensorboard": False,
        "metrics_file": "metrics.jsonl",
    },
}


def _start(
    workdir: Path, memory_root: Path | None, job_id: str, checkpoint: dict | None = None, steps: int = STEPS
) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps({**CONFIG, "output_dir": str(workdir)}))
    config["train"]["steps"] = steps
    if memory_root is not None:
        config["checkpoint"] = {"memory": {"every": 1}}  # and no checkpoint.dir: memory is all there is
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    (workdir / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    env = single_process_env()
    env["SLURM_JOB_ID"] = job_id  # the run's identity: a restart of one job finds its own copies
    if memory_root is not None:
        env["HPKIT_MEMORY_ROOT"] = str(memory_root)
    return subprocess.Popen(
        [sys.executable, "-m", "hpkit", "train", "--config", str(workdir / "config.yaml")],
        env=env,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _steps(workdir: Path) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r["loss"] for r in records if "event" not in r and "loss" in r}


def _complete_step(memory_root: Path) -> int:
    """The newest step whose copy the run has marked complete (its COMPLETE file holds the step), 0 if none.
    The run removes older steps as newer ones complete: glob skips a folder gone while it reads."""
    steps = [0]
    for name in glob.glob(str(memory_root / "**" / COMPLETE), recursive=True):
        with contextlib.suppress(FileNotFoundError, ValueError):
            steps.append(int(Path(name).read_text(encoding="utf-8")))
    return max(steps)


def test_a_stopped_cuda_run_resumes_from_node_memory_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    memory_root = Path(tempfile.mkdtemp(prefix="hpkit-mem-gpu-", dir=shm))
    runs: list[subprocess.Popen] = []
    try:
        first = _start(tmp_path / "run", memory_root, "4401")
        runs.append(first)
        deadline = time.monotonic() + 300
        while _complete_step(memory_root) < STOP_AFTER and first.poll() is None:
            assert time.monotonic() < deadline, "no in-memory step completed in 300 s"
            time.sleep(0.002)
        first.send_signal(signal.SIGTERM)  # as Slurm stops a step: the run ends at a step boundary
        out, err = first.communicate(timeout=300)
        assert first.returncode == 128 + signal.SIGTERM, f"{out[-3000:]}\n{err[-5000:]}"
        assert "device=cuda" in out, out[-2000:]
        stopped = max(_steps(tmp_path / "run"))
        assert stopped < STEPS, f"the run was not stopped part-way (it reached step {stopped})"

        second = _start(tmp_path / "run", memory_root, "4401")
        runs.append(second)
        out, err = second.communicate(timeout=600)
        assert second.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
        resumed = re.search(r"resumed from memory:step-0*(\d+) at step (\d+)", out)
        assert resumed, f"the restart did not resume from node memory:\n{out[-3000:]}"
        at = int(resumed.group(2))
        assert STOP_AFTER <= at <= stopped, (at, stopped)
        # A completed run frees its node memory.
        assert not list(memory_root.rglob("step-*")), sorted(memory_root.rglob("*"))

        reference = _start(tmp_path / "reference", None, "4402")
        out, err = reference.communicate(timeout=600)
        assert reference.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    finally:
        for run in runs:  # a failed assertion leaves no run writing into node memory after the test
            if run.poll() is None:
                run.kill()
                run.wait(timeout=60)
        shutil.rmtree(memory_root, ignore_errors=True)
    got, want = _steps(tmp_path / "run"), _steps(tmp_path / "reference")
    after = [s for s in range(at + 1, STEPS + 1)]
    # metrics.jsonl is appended by both runs: the resumed run's steps are the ones after `at`.
    assert worst_relative([got[s] for s in after], [want[s] for s in after]) < 1e-4


def test_every_async_save_of_a_cuda_run_commits(tmp_path: Path) -> None:
    """`checkpoint.async_save` stages through the same pinned-memory stager: every save of the run, not only the
    first, must commit (on torch 2.11 every save after the first failed in staging, see make_stager)."""
    from hpkit.runtime.checkpoints.checkpoint import committed

    workdir = tmp_path / "async"
    saves = {"dir": str(workdir / "ckpt"), "interval": 2, "keep": 5, "async_save": True}
    run = _start(workdir, None, "4403", checkpoint=saves, steps=10)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert "device=cuda" in out, out[-2000:]
    steps = [step for step, _ in committed(workdir / "ckpt")]
    assert steps == [2, 4, 6, 8, 10], steps
