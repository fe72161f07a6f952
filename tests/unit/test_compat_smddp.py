"""The smddp alias's decision and its effect on each rank, and `hpkit train` not mistaking it for SMDDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpkit.compat import SHIM_DIR
from hpkit.compat.smddp.policy import launch_rank, verdict
from hpkit.runtime.config import RunConfig
from hpkit.validation import parse_document

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def cfg(**collectives):
    return parse_document(RunConfig, {"collectives": collectives, "instance_type": "ml.p4d.24xlarge"})


def test_no_spec_or_backend_auto_or_fallback_allowed_runs_on_the_alias():
    for config in (None, cfg(), cfg(backend="smddp", smddp_fallback=True)):
        result = verdict(config, "nccl")
        assert result.allowed
        assert result.line.startswith('smdistributed.dataparallel: backend "smddp" is hpkit\'s alias of nccl')
        assert "SMDDP is not installed here" in result.line


def test_the_line_names_an_unsupported_type():
    config = parse_document(RunConfig, {"instance_type": "ml.g5.12xlarge"})
    assert (
        "SMDDP supports only ml.p4d.24xlarge, ml.p4de.24xlarge, not ml.g5.12xlarge"
        in verdict(config, "nccl").line
    )


def test_a_spec_that_forbids_the_fallback_refuses_in_one_line_naming_the_field():
    result = verdict(cfg(backend="smddp", smddp_fallback=False), "gloo")
    assert not result.allowed
    assert len(result.line.splitlines()) == 1
    assert "collectives.smddp_fallback is false" in result.line and "smddp_fallback: true" in result.line


@pytest.mark.parametrize(
    ("env", "rank"),
    [({"RANK": "3"}, 3), ({"SLURM_PROCID": "2"}, 2), ({"OMPI_COMM_WORLD_RANK": "1"}, 1), ({}, 0)],
)
def test_launch_rank(env, rank):
    assert launch_rank(env) == rank


# The refusal's wait on ranks other than 0 (policy.REFUSAL_WAIT_S), recorded instead of slept: a launcher would end
# the waiting rank once rank 0 has exited.
RECORD_SLEEPS = (
    "import sys, hpkit.compat.smddp.policy as p; "
    "p.time = type('T', (), {'sleep': staticmethod(lambda s: print(f'waited {s}', file=sys.stderr))}); "
)


def _import_alias(rank: int, spec_path: Path) -> subprocess.Popen:
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": f"{SHIM_DIR}:{PYTHON_DIR}",
        "RANK": str(rank),
        "HPKIT_SPEC": str(spec_path),
    }
    code = RECORD_SLEEPS + (
        "import smdistributed.dataparallel.torch.torch_smddp as m; print('registered', m.HPKIT_ALIAS)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_every_rank_stops_at_the_import_and_rank_0_says_why(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "j", "compat": ["smddp"], "collectives": {"backend": "smddp"}}))
    procs = [_import_alias(rank, spec) for rank in (0, 1)]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [1, 1]
    assert out1 == "" and err0 == ""
    assert out0.splitlines() == [out0.strip()] and "collectives.smddp_fallback is false" in out0, out0
    # Rank 1 waits before it exits, so that its exit does not make the launcher end rank 0 before rank 0 said why.
    assert err1 == "waited 30.0\n", err1


def test_with_the_fallback_the_alias_registers(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(
        yaml.safe_dump({"name": "j", "collectives": {"backend": "smddp", "smddp_fallback": True}})
    )
    out, err = _import_alias(1, spec).communicate(timeout=120)
    assert out == "registered True\n", err


def test_hpkit_train_does_not_take_the_alias_for_smddp(tmp_path):
    # With the shim on the path, runtime.parallel.collectives must report SMDDP as missing, importing nothing.
    code = (
        "import sys; from hpkit.runtime.parallel.collectives import import_smddp; print(import_smddp()); "
        "print('smdistributed' in sys.modules)"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{SHIM_DIR}:{PYTHON_DIR}"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [
        "ModuleNotFoundError: smdistributed.dataparallel.torch.torch_smddp is not installed: "
        "only hpkit's compat alias of it is on the path",
        "False",
    ], proc.stderr


def test_get_local_size_is_the_steps_ranks_on_this_node_not_the_allocations():
    """`srun -N2 -n2` in a --ntasks-per-node=2 job: each task inherits SLURM_NTASKS_PER_NODE=2 (22.05, measured) and
    runs alone on its node. SMDDP's get_local_size() said 2 from that variable."""
    code = "import smdistributed.dataparallel.torch.distributed as d; print(d.get_local_rank(), d.get_local_size())"
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": f"{SHIM_DIR}:{PYTHON_DIR}",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    # (the import says first, on rank 0, that the backend is hpkit's alias)
    assert proc.stdout.splitlines()[-1:] == ["0 1"], proc.stdout + proc.stderr
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "LOCAL_WORLD_SIZE": "4"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.splitlines()[-1:] == ["0 4"], proc.stdout + proc.stderr  # torchrun's own


@pytest.mark.parametrize("library", ["dataparallel", "modelparallel"])
def test_tensorflow_scripts_are_told_only_pytorch_is_provided(library):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{SHIM_DIR}:{PYTHON_DIR}"}
    code = f"import smdistributed.{library}.tensorflow"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"ImportError: smdistributed.{library}.tensorflow: hpkit's compat layer provides only"
    )
    assert f"smdistributed.{library}.torch" in last
