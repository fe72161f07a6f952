"""resilience.keep_survivors inside the rank, without Slurm: a rank whose peer died runs the next step's run in the
same process, as another rank, and its run is the one a new process would have run (hpkit.runtime.stay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_resilience import training_spec

from hpkit.rendezvous import free_local_ports

SCRIPT = Path(__file__).with_name("stay_layouts.py")
STEPS = 6


def config(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    spec = training_spec(name, tmp, STEPS, interval=STEPS, launcher="srun")
    # No persistent checkpoint to resume from: the second run's state comes from the in-memory tier.
    spec["checkpoint"] = {"memory": {"every": 1}}
    # The second run's rendezvous waits for the spare, a cold process: on a loaded 2-core host its start alone can
    # take tens of seconds (the survivor's first failure comes from a closed socket, not from this timeout).
    spec["resilience"]["collective_timeout_s"] = 120
    path.write_text(yaml.safe_dump(spec))
    return path


def start(role: str, cfg: Path, port: int, tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), role, str(cfg), str(port), str(tmp / "shm")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_rank_that_stays_and_comes_back_as_another_rank_trains_and_saves_as_a_new_process(tmp_path):
    """The survivor was rank 1 and comes back as rank 0 beside a new rank 1 (torchrun's rendezvous orders ranks
    anew): it resumes from the in-memory tier, every save of its run completes, and every loss equals the
    uninterrupted run's. Without forget_the_run it saved its shards at rank 1's offsets (DTensor's caches gave
    its new parameters the old run's mesh), and every save failed; and it kept the old run's gloo threads."""
    (tmp_path / "plain").mkdir()
    plain_cfg = config(tmp_path / "plain", "plain")
    (tmp_path / "stay").mkdir()
    stay_cfg = config(tmp_path / "stay", "stay")
    port, plain_port = free_local_ports(2), free_local_ports(1)
    plain = [start(f"plain-{r}", plain_cfg, plain_port, tmp_path / "plain") for r in (0, 1)]
    survivor = start("survivor", stay_cfg, port, tmp_path / "stay")
    victim = start("victim", stay_cfg, port, tmp_path / "stay")
    victim_out, _ = victim.communicate(timeout=300)
    spare = start("spare", stay_cfg, port, tmp_path / "stay")
    outs = {}
    for name, proc in (
        ("survivor", survivor),
        ("spare", spare),
        ("plain-0", plain[0]),
        ("plain-1", plain[1]),
    ):
        outs[name], _ = proc.communicate(timeout=300)
    assert victim.returncode != 0, victim_out
    procs = {"survivor": survivor, "spare": spare, "plain-0": plain[0], "plain-1": plain[1]}
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, outs[name])
    assert "stays: " in outs["survivor"] and "stays: None" not in outs["survivor"], outs["survivor"]
    assert "resumed from memory:step-" in outs["survivor"], outs["survivor"]
    # The first run's group is gone with its threads before the second starts: nothing of torch's (a default
    # argument, a cache keyed by its mesh) holds it, so a rank that stays through many steps keeps none of them.
    assert "threads of the broken group: 0" in outs["survivor"], outs["survivor"]
    assert "not completed" not in outs["survivor"] + outs["spare"], outs["survivor"]
    reference, got = losses(tmp_path / "plain" / "plain.jsonl"), losses(tmp_path / "stay" / "stay.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1)), got
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=1e-6, abs=1e-7), f"step {step}"
