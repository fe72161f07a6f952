"""`hpkit data prepare` killed with -9 the moment a shard file appears, then run again: the output is
byte-identical to one uninterrupted run (with another worker count), resumed in the middle of a document."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from _dirwatch import DirWatch

from data_corpus import documents, train_tokenizer, write_corpus
from hpkit.data.index import STATE_NAME

REPO = Path(__file__).resolve().parents[2]
SHARD = 1000


def _cmd(inputs: list[str], tok: Path, out: Path, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "hpkit", "data", "prepare", *inputs,
        "--tokenizer", str(tok), "--out", str(out), "--shard-tokens", str(SHARD), "--workers", str(workers),
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "python")}


def _tree(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# Shards the prepare may finish between the kill's shard appearing and the kill landing: the watcher polls, and on
# a loaded host the workers run ahead of it (ci58: two more shards were recorded than the one watched for).
SLACK = 3


def _mid_document_boundaries(reference: Path, eos: int) -> list[int]:
    """Shard numbers k whose start (k*SHARD) falls inside a document, as do the starts of the SLACK shards after
    it: wherever among them the kill lands, the resume starts inside a document."""
    index = json.loads((reference / "index.json").read_text())
    stream = np.concatenate(
        [np.fromfile(reference / s["name"], dtype=index["dtype"]) for s in index["shards"]]
    )
    inside = {k for k in range(1, len(index["shards"])) if stream[k * SHARD - 1] != eos}
    return [k for k in sorted(inside) if all(k + j in inside for j in range(1, SLACK + 1))]


def test_kill_9_when_a_shard_appears_then_resume_gives_the_uninterrupted_output(tmp_path):
    docs = documents(2500, seed=1)
    tok = train_tokenizer(tmp_path / "tok", docs[:300])
    inputs = [str(p) for p in write_corpus(tmp_path / "in", docs)]
    reference = tmp_path / "reference"
    subprocess.run(_cmd(inputs, tok, reference, 1), env=_env(), check=True, capture_output=True, timeout=300)
    eos = json.loads((reference / "index.json").read_text())["eos_id"]
    candidates = [k for k in _mid_document_boundaries(reference, eos) if k >= 3]
    assert len(json.loads((reference / "index.json").read_text())["shards"]) > 40 and candidates
    kill_at = f"shard-{candidates[0]:05d}.bin"

    out = tmp_path / "out"
    out.mkdir()
    with DirWatch() as watch:
        watch.add(out)
        proc = subprocess.Popen(
            _cmd(inputs, tok, out, 2),
            env=_env(),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                if any(name == kill_at for _, name, _ in watch.events(1.0)):
                    os.killpg(proc.pid, signal.SIGKILL)  # the main process and its workers
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"ran to the end before the kill: {err.decode()[-2000:]}"
    assert not (out / "index.json").exists()
    state = json.loads((out / STATE_NAME).read_text())
    assert candidates[0] <= len(state["shards"]) <= candidates[0] + SLACK, "the kill landed near its shard"
    assert state["cursor"]["skip"] > 0, "the kill landed where the next shard starts inside a document"

    done = subprocess.run(_cmd(inputs, tok, out, 2), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resumed after {len(state['shards'])} shards" in done.stdout
    assert _tree(out) == _tree(reference)
