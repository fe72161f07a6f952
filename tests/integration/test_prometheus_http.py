"""The HTTP endpoint of a real 2-process training run, scraped while it trains and parsed with prometheus-client."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import yaml
from _torchrun import REPO, torch_env, torchrun_command
from prometheus_client.parser import text_string_to_metric_families

from hpkit.rendezvous import free_local_ports

pytestmark = pytest.mark.dist

MODEL = {"name": "debug", "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 64}


def scrape(port: int) -> dict[str, tuple[dict[str, str], float]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None  # not listening yet
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def test_each_rank_serves_its_metrics_on_port_plus_local_rank_during_the_run(tmp_path):
    port = free_local_ports(2)  # local ranks 0 and 1 listen on port and port + 1
    metrics = tmp_path / "m.jsonl"
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "http",
                "output_dir": str(tmp_path / "logs"),
                "parallelism": {"dp_shard": 2},
                "model": {**MODEL, "vocab_size": 128, "seq_len": 16},
                "train": {
                    "steps": 120,
                    "local_batch_size": 2,
                    "mixed_precision": "fp32",
                    "tensorboard": False,
                    "metrics_file": str(metrics),
                    "prometheus": {"port": port},
                },
            }
        )
    )
    env = torch_env(tmp_path / "tmp")
    proc = subprocess.Popen(
        torchrun_command(["-m", "hpkit", "train", "--config", str(config)], 2, env, "--standalone"),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    got: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline and len(got) < 2:
            for local_rank in (0, 1):
                found = scrape(port + local_rank)
                if found and found.get("hpkit_train_step", ({}, 0))[1] >= 3:
                    got[local_rank] = found
            time.sleep(0.1)
        assert len(got) == 2, f"scraped {sorted(got)} before the run ended or the time ran out"
    finally:
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]
    for local_rank, found in got.items():
        assert found["hpkit_train_step"][0]["rank"] == str(local_rank)
        assert found["hpkit_train_step"][0]["node"] == socket.gethostname()
    rank0 = got[0]
    logged = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
    record = logged[int(rank0["hpkit_train_step"][1])]
    for name, key in [
        ("hpkit_train_loss", "loss"),
        ("hpkit_train_tokens_per_second", "tokens_per_s"),
        ("hpkit_train_step_seconds", "step_time_s"),
        ("hpkit_train_learning_rate", "lr"),
    ]:
        assert rank0[name][1] == record[key], name
    # The run ended: its servers are shut, the ports free again.
    assert scrape(port) is None and scrape(port + 1) is None
