"""A job that takes every GPU of its instance type gets the whole node and its vCPUs shared among its ranks."""

from __future__ import annotations

import pytest

from hpkit.catalog import lookup
from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import parse_document


def directives(**fields) -> list[str]:
    spec = parse_document(JobSpec, {"name": "j", "nodes": 2, "command": ["python3", "train.py"], **fields})
    return [line for line in render(spec).splitlines() if line.startswith("#SBATCH") or "whole node" in line]


@pytest.mark.parametrize(("launcher", "cpus"), [("torchrun", "192"), ("srun", "24")])
def test_all_gpus_of_a_p5_take_the_node_with_24_vcpus_per_rank(launcher, cpus):
    lines = directives(gpus_per_node=8, instance_type="ml.p5.48xlarge", launcher=launcher)
    assert f"#SBATCH --cpus-per-task={cpus}" in lines
    assert "#SBATCH --exclusive" in lines
    note = lines[lines.index("#SBATCH --exclusive") - 1]
    assert note.startswith("# whole node: the job uses all 8 GPUs") and "192 vCPUs, 24 per rank" in note


def test_opting_out_fewer_gpus_or_own_cpus_keep_the_shared_node():
    assert "#SBATCH --exclusive" not in directives(
        gpus_per_node=8, instance_type="p5.48xlarge", whole_node=False
    )
    assert "#SBATCH --exclusive" not in directives(
        gpus_per_node=4, instance_type="p5.48xlarge", tasks_per_node=4
    )
    own = directives(gpus_per_node=8, instance_type="p5.48xlarge", cpus_per_task=4)
    assert "#SBATCH --exclusive" not in own and "#SBATCH --cpus-per-task=32" in own


def test_catalog_vcpus_are_awss_figures():
    assert [
        lookup(t).vcpus for t in ("p4d.24xlarge", "p5.48xlarge", "g5.xlarge", "g5.12xlarge", "g6e.48xlarge")
    ] == [
        96,
        192,
        4,
        48,
        192,
    ]
