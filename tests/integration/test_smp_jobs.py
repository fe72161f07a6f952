"""Seed 000's two SMP scripts, unchanged but for their data, through `hpkit import-sagemaker` + `hpkit submit`
on the real local cluster (2 nodes x 2 ranks): each layout's per-step losses and final weights equal the
same script's on one process."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_slurm_jobs import hpkit, output_of, submit, unlabelled

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


def _losses(log: str) -> dict[int, dict[int, list[float]]]:
    """dp rank -> step -> the losses its ranks printed (every rank of a replica prints its loss)."""
    by_replica: dict[int, dict[int, list[float]]] = {}
    for m in re.finditer(r"smp-loss (\{[^{}]*\})", log):
        r = json.loads(m.group(1))
        by_replica.setdefault(r["dp_rank"], {}).setdefault(r["step"], []).append(r["loss"])
    return by_replica


def _layouts(log: str) -> dict[int, dict]:
    return {(d := json.loads(m.group(1)))["rank"]: d for m in re.finditer(r"smp-layout (\{.*\})", log)}


def _digest(log: str) -> dict[str, list[float]]:
    (line,) = re.findall(r"smp-state (\{.*\})", log)
    return json.loads(line)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[tuple[str, int], str]:
    """Each script's output on one plain process (degrees 1) reading what `replicas` replicas read together."""
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
    for script, replicas in sorted({(script, replicas) for script, _, replicas in LAYOUTS}):
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / script)],
            env={**env, "SMP_SEED_REPLICAS": str(replicas)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        logs[(script, replicas)] = done.stdout
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
        2,
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
        1,
    ),
    ("tp_pp.py", {"microbatches": 4, "pipeline_parallel_degree": 2, "ddp": True}, 2),
]


@pytest.mark.parametrize(("script", "parameters", "replicas"), LAYOUTS, ids=["tp2xdp2", "tp2xpp2", "pp2xdp2"])
def test_seed_000_layout_matches_one_process(
    slurm_cluster, tmp_path, one_process, script, parameters, replicas
):
    name = "smp-" + "-".join(
        f"{k[:2]}{v}" for k, v in parameters.items() if isinstance(v, int) and v is not True
    )
    spec = _imported_spec(tmp_path, slurm_cluster, script, parameters, name)
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=400)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    tp = parameters.get("tensor_parallel_degree", 1)
    pp = parameters.get("pipeline_parallel_degree", 1)
    assert replicas == 4 // (tp * pp)
    reference_log = one_process[(script, replicas)]

    # The layout is the one asked for, seen on every rank.
    (full,) = _layouts(reference_log).values()
    layouts = _layouts(log)
    assert sorted(layouts) == [0, 1, 2, 3], log
    planned = {module for layout in layouts.values() for module in layout["tp_plan"]}
    assert bool(planned) == (tp > 1), planned
    for rank, layout in layouts.items():
        if tp > 1:
            for module in planned:
                if f"{module}.weight" not in layout["shards"]:
                    continue  # on another pipeline stage
                assert module in layout["tp_plan"], f"rank {rank} holds {module} outside the plan"
                shard, whole = layout["shards"][f"{module}.weight"], full["shards"][f"{module}.weight"]
                # Colwise cuts the output dim, rowwise the input dim: one of them is halved, never neither.
                assert sorted([shard[0] * tp == whole[0], shard[1] * tp == whole[1]]) == [False, True], (
                    f"rank {rank}: {module}.weight is {shard} of {whole}"
                )
        else:
            assert layout["tp_plan"] == {} and all(
                layout["shards"][n] == full["shards"][n] for n in layout["shards"]
            )
    if pp > 1:
        stages = {}
        for layout in layouts.values():
            stages.setdefault(layout["pp_rank"], set()).update(layout["shards"])
        assert len(stages) == pp and all(stages.values())
        assert set.union(*stages.values()) == set(full["shards"]), stages
        assert sum(len(names) for names in stages.values()) == len(full["shards"]), "stages overlap"

    # Every replica trained on its own data; their mean is the reference's loss, step by step.
    (reference,) = _losses(reference_log).values()
    reference = [statistics.fmean(reference[step]) for step in sorted(reference)]
    assert len(reference) == STEPS and len(set(reference)) == STEPS, f"the losses must move: {reference}"
    by_replica = _losses(log)
    assert sorted(by_replica) == list(range(replicas)), log
    means = []
    for step in range(STEPS):
        per_replica = []
        for dp_rank, steps in by_replica.items():
            assert len(steps[step]) == 4 // replicas, f"step {step}, replica {dp_rank}: {steps[step]}"
            assert max(steps[step]) - min(steps[step]) < 1e-5, f"one replica, one loss: {steps[step]}"
            per_replica.append(steps[step][0])
        if replicas > 1:
            assert max(per_replica) - min(per_replica) > 1e-3, f"step {step}: replicas read the same data"
        means.append(statistics.fmean(per_replica))
    assert means == pytest.approx(reference, abs=1e-5), f"{means} != {reference}"

    # The gathered state_dict (every stage, whole tensors) ends where the single process ends.
    ref_digest, digest = _digest(reference_log), _digest(log)
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
    lines = [line for line in unlabelled(log).splitlines() if line.startswith("smp: ")]
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
