"""What `hpkit train` takes from a whole job spec beyond the training blocks."""

from __future__ import annotations

import yaml

from hpkit.runtime.env import DeviceInfo, LaunchEnv
from hpkit.runtime.run import choose_collectives
from hpkit.spec import load_run_config


def test_whole_spec_carries_resilience_and_collectives(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "j",
                "instance_type": "ml.p4d.24xlarge",
                "resilience": {"collective_timeout_s": 42},
                "collectives": {"backend": "smddp", "smddp_fallback": True},
            }
        )
    )
    cfg = load_run_config(path)
    assert cfg.resilience.collective_timeout_s == 42
    assert cfg.collectives.backend == "smddp" and cfg.collectives.smddp_fallback
    assert cfg.instance_type == "ml.p4d.24xlarge"


def test_cpu_keeps_gloo_whatever_the_collectives_block_says(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "j", "collectives": {"backend": "smddp"}}))
    cpu = DeviceInfo("cpu", None, "gloo", "x86_64")
    launch = LaunchEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")
    assert choose_collectives(load_run_config(path), launch, cpu) is cpu
