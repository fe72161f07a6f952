"""`%j` under plain `torchrun` (no --standalone, no --rdzv-id): the job id there is torchrun's placeholder
`none`, which is no id. The checkpoint directory must be the one every run without a job id uses (`local`),
named the same by every rank, and found again by the next launch, which resumes from it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import _torchrun
import pytest
import yaml
from training_layouts import BASE

from hpkit.rendezvous import free_local_ports

pytestmark = pytest.mark.dist


def _config(tmp: Path, steps: int) -> Path:
    cfg = {
        "name": "ident",
        "output_dir": str(tmp / "out"),
        "parallelism": {"dp_shard": 2},
        "model": BASE["model"],
        "train": {"steps": steps, "local_batch_size": 2, "mixed_precision": "fp32", "tensorboard": False},
        "checkpoint": {"dir": str(tmp / "ckpt" / "%j"), "interval": 1, "keep": 1},
    }
    path = tmp / f"run-{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plain_torchrun(config: Path, tmp: Path) -> subprocess.CompletedProcess:
    # torchrun's default static rendezvous needs a port of its own (--standalone would pick one, but
    # also set a random run id, which is not the case under test).
    port = free_local_ports()
    env = _torchrun.torch_env(tmp)
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = _torchrun.torchrun_command(
        ["-m", "hpkit", "train", "--config", str(config)], 2, env, "--master-port", str(port)
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=_torchrun.REPO)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return done


def test_job_pattern_under_plain_torchrun_is_local_and_resumes(tmp_path):
    first = _plain_torchrun(_config(tmp_path, 2), tmp_path / "t")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["local"], first.stdout
    assert (tmp_path / "ckpt" / "local" / "latest").read_text().strip() == "step-00000002"

    second = _plain_torchrun(_config(tmp_path, 3), tmp_path / "t")
    assert f"resumed from {tmp_path / 'ckpt' / 'local' / 'step-00000002'} at step 2" in second.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["local"]
    # No job id: each launch's metrics file is named by its start time, and records where it saved.
    files = sorted((tmp_path / "out").glob("ident-*.metrics.jsonl"))
    assert len(files) == 2 and not any("none" in f.name for f in files), files
    saved = [
        r["path"]
        for f in files
        for r in map(json.loads, f.read_text().splitlines())
        if r.get("event") == "checkpoint"
    ]
    assert saved and all(Path(p).parent == tmp_path / "ckpt" / "local" for p in saved)
