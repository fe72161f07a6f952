"""What `hpkit train` takes from a whole job spec beyond the training blocks."""

from __future__ import annotations

import pytest
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


def test_a_sagemaker_degree_name_is_checked_under_that_name():
    """tensor_parallel_degree is renamed to tp before the fields are checked: a bad value must be reported under the
    name the user wrote, not as `tp` (which the user's file does not have). Its text and float forms pass."""
    from hpkit.runtime.config import ParallelismSpec

    for value in ("x", 2.5, True, [2]):
        with pytest.raises(ValueError, match=r"tensor_parallel_degree: .* is not a whole number") as err:
            ParallelismSpec.model_validate({"tensor_parallel_degree": value})
        assert "\ntp\n" not in str(err.value)
    for value in (2, "2", 2.0):
        assert ParallelismSpec.model_validate({"tensor_parallel_degree": value}).tp == 2
