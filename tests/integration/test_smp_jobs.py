"""Seed 000's two SMP scripts, unchanged but for their data, through `hpkit import-sagemaker` + `hpkit submit`
on the real local cluster (2 nodes x 2 ranks): each layout's per-step losses and final weights equal the
same script's on one process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_slurm_jobs import hpkit, output_of, submit

from hpkit.compat import SHIM_DIR
from hpkit.slurm import CliBackend, JobState, wait

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests/fixtures/smp_seed000"
STEPS = 3
# The seed's estimator options, on 2 instances x 2 processes instead of 1 x 8.
MPI = {
    "enabled": True,
    "processes_per_host": 2,
    "custom_mpi_options": "--mca btl_vader_single_copy_mechanism none ",
}


def _estimator(script: str, parameters: dict) -> dict:
    return {
        "entry_point": script,
        "role": "role",
        "instance_type": "ml.p3.16xlarge",
        "framework_version": "1.13.1",
        "py_version": "py36",
        "instance_count": 2,
        "base_job_name": "SMD-MP-demo",
        "distribution": {
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
            "mpi": MPI,
        },
    }


def _imported_spec(tmp_path: Path, env: dict[str, str], script: str, parameters: dict, name: str) -> dict:
    est = tmp_path / f"{name}.est.json"
    est.write_text(json.dumps(_estimator(script, parameters)))
    out = tmp_path / f"{name}.imported.yaml"
    proc = hpkit("import-sagemaker", str(est), "-o", str(out), "--name", name, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(out.read_text())
    assert spec["compat"] == ["smp"] and spec["smp_parameters"] == parameters
    # The task runs this test's interpreter on the transcribed script (the estimator names the bare file).
    spec["command"] = [sys.executable, str(SCRIPTS / script)]
    # The seed's ml.p3.16xlarge has 8 GPUs, one rank each; the dev cluster's nodes have none and 2 CPUs,
    # so the ranks run on CPUs, processes_per_host of them per node.
    spec["gpus_per_node"] = 0
    spec["tasks_per_node"] = MPI["processes_per_host"]
    spec["env"] = {**spec.get("env", {}), "OMP_NUM_THREADS": "1", "SMP_SEED_STEPS": str(STEPS)}
    return spec


def _losses(log: str) -> dict[int, list[float]]:
    by_rank: dict[int, dict[int, float]] = {}
    for m in re.finditer(r"smp-loss (\{[^{}]*\})", log):
        r = json.loads(m.group(1))
        by_rank.setdefault(r["rank"], {})[r["step"]] = r["loss"]
    return {rank: [steps[s] for s in sorted(steps)] for rank, steps in by_rank.items()}


def _digest(log: str) -> dict[str, list[float]]:
    (line,) = re.findall(r"smp-state (\{.*\})", log)
    return json.loads(line)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, str]:
    """Each script's output on one plain process (degrees 1), as the reference."""
    tmp = tmp_path_factory.mktemp("smp-one")
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HPKIT_SPEC", "SLURM_PROCID")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(SHIM_DIR), str(REPO / "python")]),
        OMP_NUM_THREADS="1",
        SMP_SEED_STEPS=str(STEPS),
        TMPDIR=str(tmp),
    )
    logs = {}
    for script in ("tp_only.py", "tp_pp.py"):
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-4000:]
        logs[script] = done.stdout
    return logs


LAYOUTS = [
    (
        "tp_only.py",
        {
            "pipeline_parallel_degree": 1,
            "placement_strategy": "cluster",
            "tensor_parallel_degree": 2,
            "ddp": True,
        },
    ),
    (
        "tp_pp.py",
        {
            "microbatches": 4,
            "pipeline_parallel_degree": 2,
            "placement_strategy": "cluster",
            "tensor_parallel_degree": 2,
            "ddp": True,
        },
    ),
    ("tp_pp.py", {"microbatches": 4, "pipeline_parallel_degree": 2, "ddp": True}),
]


@pytest.mark.parametrize(("script", "parameters"), LAYOUTS, ids=["tp2xdp2", "tp2xpp2", "pp2xdp2"])
def test_seed_000_layout_matches_one_process(slurm_cluster, tmp_path, one_process, script, parameters):
    name = "smp-" + "-".join(
        f"{k[:2]}{v}" for k, v in parameters.items() if isinstance(v, int) and v is not True
    )
    spec = _imported_spec(tmp_path, slurm_cluster, script, parameters, name)
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=400)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    reference = _losses(one_process[script])[0]
    assert len(reference) == STEPS
    losses = _losses(log)
    assert sorted(losses) == [0, 1, 2, 3], log
    for rank, got in losses.items():
        assert got == pytest.approx(reference, abs=1e-5), f"rank {rank}: {got} != {reference}"
    # The gathered state_dict (every stage, whole tensors) ends where the single process ends.
    ref_digest, digest = _digest(one_process[script]), _digest(log)
    assert sorted(digest) == sorted(ref_digest)
    for key, (total, norm) in digest.items():
        assert total == pytest.approx(ref_digest[key][0], rel=1e-5, abs=1e-4), key
        assert norm == pytest.approx(ref_digest[key][1], rel=1e-5), key
    if "placement_strategy" in parameters:
        assert log.count("smp: warning: placement_strategy='cluster' is ignored") == 1, log


def test_bad_degree_stops_every_rank_with_one_line(slurm_cluster, tmp_path):
    """import-sagemaker and submit already refuse degrees that do not fit the job; smp.init checks SMP's
    own parameters again (smp_parameters edited by hand, or smp.init(config)), before any collective."""
    parameters = {"tensor_parallel_degree": 2, "ddp": True}
    spec = _imported_spec(tmp_path, slurm_cluster, "tp_only.py", parameters, "smp-bad-tp3")
    spec.pop("parallelism")
    spec["smp_parameters"]["tensor_parallel_degree"] = 3
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=120)
    log = output_of(info)
    assert info.state == JobState.FAILED, log
    lines = [line for line in log.splitlines() if line.startswith("smp: ")]
    assert lines == [
        "smp: tensor_parallel_degree: tensor_parallel_degree=3 x pipeline_parallel_degree=1 = 3 does not "
        "divide the 4 processes; choose degrees whose product divides 4"
    ], log
    assert "Traceback" not in log
    # srun reports every task's end: each exited 1 by itself, or srun ended it once a peer had failed
    # (a rank that was still starting); none is left running.
    ended = re.findall(r"tasks? ([\d,-]+): (?:Exited with exit code 1|Terminated)", log)
    assert _count_tasks(ended) == 4, log


def _count_tasks(ranges: list[str]) -> int:
    total = 0
    for group in ranges:
        for part in group.split(","):
            lo, _, hi = part.partition("-")
            total += int(hi or lo) - int(lo) + 1
    return total
