"""Training on a prepared directory (`train.data: {kind: prepared}`) sees exactly the samples an
uninterrupted run sees: after a kill -9 and resume on 2 ranks, and resumed at dp=1 from a dp=2 checkpoint.

Each rank records "global-sample-index sha1" for every sample it trains on (HPKIT_DATA_DIGESTS), so the
runs are compared sample by sample, not only through their losses.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _torchrun
import pytest
import yaml
from _dirwatch import DirWatch

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from data_corpus import documents, train_tokenizer, write_corpus
from hpkit.data.prepare import Options, prepare
from hpkit.rendezvous import free_local_ports

pytestmark = pytest.mark.dist

STEPS, LOCAL, SEQ = 6, 4, 16
GLOBAL = 2 * LOCAL
MODEL = {
    "name": "debug",
    "dim": 32,
    "n_layers": 2,
    "n_heads": 2,
    "ffn_dim": 64,
    "vocab_size": 512,
    "seq_len": SEQ,
}


def _spec(tmp: Path, tag: str, data: Path, dp: int, local: int) -> Path:
    spec = {
        "name": f"prepared-{tag}",
        "output_dir": str(tmp / "out" / tag),
        "parallelism": {"dp_shard": dp},
        "model": MODEL,
        "train": {
            "steps": STEPS,
            "local_batch_size": local,
            "lr": 3e-3,
            "mixed_precision": "fp32",
            "tensorboard": False,
            "seed": 7,
            "metrics_file": f"{tag}.metrics.jsonl",
            "data": {"kind": "prepared", "path": str(data)},
        },
        "checkpoint": {"dir": str(tmp / f"ckpt-{tag}"), "interval": 2, "keep": 3},
    }
    path = tmp / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _digests(directory: Path) -> dict[int, str]:
    """sample index -> digest over every rank's record; a sample seen twice must have read the same tokens."""
    seen: dict[int, str] = {}
    for log in sorted(directory.glob("rank-*.log")):
        for line in log.read_text().splitlines():
            index, digest = line.split()
            assert seen.setdefault(int(index), digest) == digest, f"sample {index} read differently"
    return seen


def _losses(tmp: Path, tag: str) -> dict[int, float]:
    lines = (tmp / "out" / tag / f"{tag}.metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _launch_2_ranks(cfg: Path, tmp: Path, digests: Path) -> tuple[list[subprocess.Popen], list[int]]:
    """Two ranks without an agent, forked by this test process's zygote where they can be (_torchrun.warm): what
    was started (each rank's client, or the rank), and the ranks' own pids (_torchrun.rank_pid) to kill."""
    port = free_local_ports()
    procs: list[subprocess.Popen] = []
    pids: list[int] = []
    for rank in range(2):
        env = _torchrun.torch_env(tmp / "tmp")
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HPKIT_DATA_DIGESTS=str(digests),
        )  # fmt: skip
        cmd = _torchrun.warm([sys.executable, "-m", "hpkit", "train", "--config", str(cfg)], env)
        since = time.monotonic()
        with (tmp / f"killed.rank{rank}.log").open("w") as out:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=_torchrun.REPO)
            )
        pids.append(_torchrun.rank_pid(procs[-1], since))
    return procs, pids


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prepared")
    docs = documents(200, seed=3)
    tok = train_tokenizer(tmp / "tok", docs)
    data = tmp / "data"
    prepare(Options([str(p) for p in write_corpus(tmp / "in", docs)], str(tok), data, shard_tokens=1000))
    digests = {tag: tmp / f"digests-{tag}" for tag in ("u", "k", "r", "d")}
    for path in digests.values():
        path.mkdir()

    def train(tag: str, spec: Path, nproc: int) -> str:
        args = ["-m", "hpkit", "train", "--config", str(spec)]
        digest = {"HPKIT_DATA_DIGESTS": str(digests[tag])}
        return _torchrun.run(args, tmp / f"tmp-{tag}", nproc, extra_env=digest).stdout

    def killed(spec_k: Path) -> list[int | None]:
        """K: killed with -9 the moment its step-4 checkpoint is committed (renamed into place)."""
        (tmp / "ckpt-k").mkdir()
        with DirWatch() as watch:
            watch.add(tmp / "ckpt-k")
            procs, pids = _launch_2_ranks(spec_k, tmp, digests["k"])
            deadline = time.monotonic() + 300
            try:
                while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                    if any(name == "step-00000004" for _, name, _ in watch.events(1.0)):
                        _torchrun.sigkill(pids)
                        break
            finally:
                for p in procs:
                    if p.poll() is None:
                        _torchrun.sigkill(pids)
                    p.wait(timeout=60)
        return [p.returncode for p in procs]

    # U and K, then K resumed (R) and U's step-4 checkpoint resumed on one rank (D): two runs at a time, each
    # with its own output folder (the hang watchdog's boards are keyed by it) and digests.
    spec_k = _spec(tmp, "k", data, 2, LOCAL)
    with ThreadPoolExecutor(2) as pool:
        u = pool.submit(train, "u", _spec(tmp, "u", data, 2, LOCAL), 2)
        k_codes = pool.submit(killed, spec_k)
        out = {"u": u.result(), "k_codes": k_codes.result()}
    # D: with the same global batch (8 = 1 x 8).
    (tmp / "ckpt-d").mkdir()
    shutil.copytree(tmp / "ckpt-u" / "step-00000004", tmp / "ckpt-d" / "step-00000004")
    with ThreadPoolExecutor(2) as pool:
        r = pool.submit(train, "r", spec_k, 2)
        d = pool.submit(train, "d", _spec(tmp, "d", data, 1, GLOBAL), 1)
        out["r"], out["d"] = r.result(), d.result()
    return tmp, out, {tag: _digests(path) for tag, path in digests.items()}


def test_the_uninterrupted_run_reads_each_global_sample_once(runs):
    _, out, seen = runs
    assert "hpkit train: done steps=6 " in out["u"]
    assert sorted(seen["u"]) == list(range(STEPS * GLOBAL))
    assert len(set(seen["u"].values())) > STEPS * GLOBAL // 2, "windows of real text, not one repeated row"


def test_killed_and_resumed_sees_exactly_the_uninterrupted_batches(runs):
    tmp, out, seen = runs
    assert out["k_codes"] == [-signal.SIGKILL] * 2, "killed, not finished"
    assert set(seen["k"]) >= set(range(4 * GLOBAL)), "the killed run trained through step 4"
    assert all(seen["u"][i] == d for i, d in seen["k"].items())
    # A kill between the directory's rename and the `latest` update resumes from the one before (step 2).
    found = re.search(rf"resumed from {re.escape(str(tmp / 'ckpt-k'))}/step-0*(\d+) at step (\d+)", out["r"])
    assert found and found.group(1) == found.group(2) and int(found.group(1)) in (2, 4), out["r"]
    step = int(found.group(1))
    assert seen["r"] == {i: d for i, d in seen["u"].items() if i >= step * GLOBAL}
    resumed = {s: v for s, v in _losses(tmp, "k").items() if s > 4}
    assert resumed == {s: _losses(tmp, "u")[s] for s in (5, 6)}, "same batches, same weights: same losses"


def test_resumed_at_dp_1_from_a_dp_2_checkpoint_continues_with_the_next_unseen_samples(runs):
    tmp, out, seen = runs
    assert f"resumed from {tmp / 'ckpt-d' / 'step-00000004'} at step 4" in out["d"]
    assert "world=1 " in out["d"]
    assert seen["d"] == {i: d for i, d in seen["u"].items() if i >= 4 * GLOBAL}
