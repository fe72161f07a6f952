"""The compat plumbing: the spec field, the rendered PYTHONPATH step, and a real install winning over the shim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.compat import SHIM_DIR
from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.slurm.script import compat_step
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def spec(**fields):
    return parse_document(JobSpec, {"name": "sm", "nodes": 2, "tasks_per_node": 2, **fields})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(["smddp"], ["smddp"]), ("smp", ["smp"]), (["smddp", "smp", "smddp"], ["smddp", "smp"]), ([], [])],
)
def test_compat_accepts_the_two_layers(value, expected):
    assert spec(compat=value).job.compat == expected


@pytest.mark.parametrize("value", [["smdp"], ["smp", "horovod"], [None], 3, {"smddp": True}])
def test_a_bad_compat_entry_is_one_line_naming_the_field(value):
    with pytest.raises(SpecError) as err:
        spec(compat=value)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("spec: compat: ")
    if isinstance(value, list):
        assert "use smp, smp_v2, smddp" in message


def test_smp_parameters_are_kept_as_given():
    params = {"tensor_parallel_degree": 2, "placement_strategy": "cluster", "ddp": True}
    assert spec(compat=["smp"], smp_parameters=params).job.smp_parameters == params


def test_without_compat_the_script_does_not_touch_pythonpath():
    assert compat_step(spec().job) is None
    assert "hpkit.compat" not in render(spec())


def _run_step(step: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # The step as the task's bash runs it, then what the task's program would see.
    return subprocess.run(
        ["bash", "-c", f'{step}; printf "%s" "$PYTHONPATH"'],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_the_task_asks_its_own_python_for_the_shim_and_prepends_it():
    step = compat_step(spec(compat=["smddp"], command=[sys.executable, "train.py"]).job)
    assert step is not None and sys.executable in step
    proc = _run_step(step, {"PATH": os.environ["PATH"], "PYTHONPATH": f"{PYTHON_DIR}:/elsewhere"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(":") == [str(SHIM_DIR), str(PYTHON_DIR), "/elsewhere"]


def test_a_task_python_without_hpkit_stops_with_one_line(tmp_path):
    # An interpreter that cannot import hpkit, as in a container image without it.
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'No module named hpkit' >&2\nexit 1\n")
    fake.chmod(0o755)
    step = compat_step(spec(compat=["smp"], command=[str(fake), "train.py"]).job)
    proc = _run_step(step, {"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"hpkit: compat: {fake} cannot import hpkit where the task runs: install hpkit there (in the container "
        "image too), or drop compat from the spec"
    ]


def test_a_command_that_is_not_python_asks_python3():
    assert "python3 -m hpkit.compat" in compat_step(spec(compat=["smddp"], command=["bash", "run.sh"]).job)


PROBE = """
import importlib.util, json, smdistributed, smdistributed.dataparallel as dp
out = {"top": smdistributed.__file__, "dp": dp.__file__, "real": getattr(smdistributed, "REAL", None)}
# Where the module is, without running it (hpkit's alias would import torch and register the backend).
out["smddp"] = importlib.util.find_spec("smdistributed.dataparallel.torch.torch_smddp").origin
print(json.dumps(out))
"""


def _probe(*path: Path) -> dict:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _fake_real(root: Path, namespace: bool = False) -> Path:
    """A stand-in for SageMaker's installed `smdistributed`: a few files in site-packages' layout."""
    pkg = root / "smdistributed"
    (pkg / "dataparallel" / "torch").mkdir(parents=True)
    if not namespace:
        (pkg / "__init__.py").write_text("REAL = 'sagemaker'\n")
    (pkg / "dataparallel" / "__init__.py").write_text("")
    (pkg / "dataparallel" / "torch" / "__init__.py").write_text("")
    (pkg / "dataparallel" / "torch" / "torch_smddp.py").write_text("")
    return pkg


def test_without_a_real_install_the_shim_answers():
    got = _probe(SHIM_DIR, PYTHON_DIR)
    assert got["top"] == str(SHIM_DIR / "smdistributed" / "__init__.py")
    assert got["dp"] == str(SHIM_DIR / "smdistributed" / "dataparallel" / "__init__.py")
    assert got["smddp"] == str(SHIM_DIR / "smdistributed" / "dataparallel" / "torch" / "torch_smddp.py")
    assert got["real"] is None


@pytest.mark.parametrize("namespace", [False, True], ids=["regular", "namespace"])
def test_a_real_install_later_on_the_path_wins(tmp_path, namespace):
    real = _fake_real(tmp_path / "site-packages", namespace=namespace)
    # The shim comes first on PYTHONPATH, as the rendered script puts it; the real install still wins.
    got = _probe(SHIM_DIR, PYTHON_DIR, real.parent)
    assert got["dp"] == str(real / "dataparallel" / "__init__.py")
    assert got["smddp"] == str(real / "dataparallel" / "torch" / "torch_smddp.py")
    if namespace:
        assert got["real"] is None
    else:
        assert got["top"] == str(real / "__init__.py") and got["real"] == "sagemaker"
