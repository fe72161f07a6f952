"""The SMDDP backend decision: spec option x importability x the instance type table's verdict."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpkit.runtime.parallel.collectives import choose_backend, decide, import_smddp


def test_auto_is_nccl_whatever_the_library():
    choice = choose_backend("auto", False, "ModuleNotFoundError: x", "ml.p5.48xlarge")
    assert (choice.backend, choice.usable) == ("nccl", True)


def test_smddp_on_a_supported_type_when_it_imports():
    choice = choose_backend("smddp", False, None, "ml.p4d.24xlarge")
    assert (choice.backend, choice.usable) == ("smddp", True)
    assert choice.reason == "collectives: SMDDP on ml.p4d.24xlarge"


@pytest.mark.parametrize("fallback", [True, False])
def test_unsupported_type_is_the_checkers_verdict(fallback):
    choice = choose_backend("smddp", fallback, None, "p5.48xlarge")
    assert "SMDDP supports only ml.p4d.24xlarge, ml.p4de.24xlarge, not p5.48xlarge" in choice.reason
    assert choice.backend == ("nccl" if fallback else "smddp")
    assert choice.usable is fallback
    assert len(choice.reason.splitlines()) == 1


def test_missing_library_falls_back_only_when_allowed():
    error = "ModuleNotFoundError: No module named 'smdistributed'"
    allowed = choose_backend("smddp", True, error, "ml.p4de.24xlarge")
    assert (allowed.backend, allowed.usable) == ("nccl", True)
    assert "not installed" in allowed.reason and "SMDDP_WHEEL_URL" in allowed.reason
    refused = choose_backend("smddp", False, error, "ml.p4de.24xlarge")
    assert not refused.usable and "smddp_fallback: true" in refused.reason


def test_decide_imports_the_real_module_here_where_it_is_absent():
    # No SMDDP wheel exists for CPU machines: the real import fails and says why.
    error = import_smddp()
    assert error is not None and "smdistributed" in error
    choice = decide("smddp", True, None)
    assert choice.backend == "nccl" and "not installed" in choice.reason


def test_importing_the_choice_loads_neither_torch_nor_the_importer_nor_the_checker(repo):
    # The runtime reads this module; it must not drag in SageMaker's importer or the checks with it.
    probe = (
        "import sys, hpkit.runtime.parallel.collectives; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('hpkit.sagemaker', 'hpkit.checks'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo / "python")},
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"
