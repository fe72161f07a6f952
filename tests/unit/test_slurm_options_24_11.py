"""#SBATCH/srun options between Slurm 22.05 and 24.11 (HyperPod's), from what both really printed
(tests/fixtures/slurm-24.11: sbatch-help.txt, srun-help.txt, cpus-per-task-srun.txt)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.slurm.options import (
    SBATCH_OPTIONS,
    SBATCH_OPTIONS_SINCE_24_11,
    SRUN_OPTIONS,
    SRUN_OPTIONS_SINCE_24_11,
)
from hpkit.slurm.script import sbatch_directives, tasks_per_node
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-24.11"


def helped(name: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", (FIXTURES / name).read_text()))


@pytest.mark.parametrize(
    ("fixture", "known", "added"),
    [
        ("sbatch-help.txt", SBATCH_OPTIONS, SBATCH_OPTIONS_SINCE_24_11),
        ("srun-help.txt", SRUN_OPTIONS, SRUN_OPTIONS_SINCE_24_11),
    ],
)
def test_every_24_11_option_is_known_and_the_additions_are_exactly_these(fixture, known, added) -> None:
    options = helped(fixture)
    assert len(options) > 80, options
    assert options <= known, f"24.11 lists options hpkit does not know: {sorted(options - known)}"
    # What 22.05 knows is checked against the host's 22.05 (test_slurm_options.py); these are 24.11's own.
    assert added <= options


def _spec(**fields) -> JobSpec:
    return parse_document(JobSpec, {"name": "j", **fields}, "job.yaml")


def test_escape_hatch_takes_24_11_options() -> None:
    spec = _spec(
        sbatch_options=["--oom-kill-step=1"], srun_options=["--tres-bind=gres/gpu:verbose,per_task:1"]
    )
    assert spec.job.sbatch_options == ["--oom-kill-step=1"]


def test_tres_per_task_beside_hpkits_cpus_per_task_is_refused_in_one_line() -> None:
    """24.11: 'You can not have --tres-per-task=cpu= and --cpus-per-task' (hpkit always writes the latter)."""
    with pytest.raises(
        SpecError, match=r"--tres-per-task=cpu:4.*hpkit sets --tres-per-task itself: use cpus_per_task"
    ):
        _spec(sbatch_options=["--tres-per-task=cpu:4"])


@pytest.mark.parametrize(
    "fields",
    [
        {"launcher": "torchrun", "tasks_per_node": 4, "cpus_per_task": 3},
        {"launcher": "srun", "tasks_per_node": 4, "cpus_per_task": 3},
        {"launcher": "srun", "tasks_per_node": 2},
        {"launcher": "mpi", "tasks_per_node": 2, "cpus_per_task": 2},
    ],
)
def test_steps_fit_the_job_when_srun_inherits_cpus_per_task(fields) -> None:
    """22.05's srun ignores the job's --cpus-per-task; 24.11's reads it (cpus-per-task-srun.txt: `srun -n2` in a
    1-task, 2-CPU job fails there). hpkit's steps start the job's tasks per node (and its probes one a node), so
    tasks x the inherited CPUs never exceeds what the directives allocate on a node, under either version."""
    job = _spec(nodes=2, **fields).job
    directives = {d.option: d.value for d in sbatch_directives(job)}
    per_task = int(directives.get("cpus-per-task", "1"))
    allocated = int(directives["ntasks-per-node"]) * per_task
    assert tasks_per_node(job) * per_task <= allocated  # the training step
    assert 1 * per_task <= allocated  # the supervisor's probes: one task a node (supervise/cluster.py)
