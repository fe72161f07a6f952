"""Parsing what the Slurm tools print, and choosing a backend."""

from __future__ import annotations

import sys
import types
from typing import ClassVar

import pytest

from hpkit import slurm
from hpkit.errors import SlurmError
from hpkit.slurm import CliBackend, JobState, _json_int, _json_state, parse_scontrol_record

# A record as 22.05's `scontrol show job -o` prints it (trimmed), with spaces inside Command=.
SCONTROL = (
    "JobId=12 JobName=train UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
    "ExitCode=3:0 NodeList=node[1-2] Command=/tmp/run job.sbatch --flag WorkDir=/tmp/w "
    "StdOut=/tmp/w/logs/train-12.out"
)


def test_parse_scontrol_record_keeps_values_with_spaces():
    fields = parse_scontrol_record(SCONTROL)
    assert fields["JobState"] == "FAILED"
    assert fields["ExitCode"] == "3:0"
    assert fields["Command"] == "/tmp/run job.sbatch --flag"
    assert fields["StdOut"] == "/tmp/w/logs/train-12.out"
    assert fields["UserId"] == "root(0)"


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("RUNNING", JobState.RUNNING),
        ("CANCELLED by 0", JobState.CANCELLED),
        ("CD", JobState.COMPLETED),
        ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
        ("WEIRD", JobState.UNKNOWN),
        ("", JobState.UNKNOWN),
    ],
)
def test_state_parsing(text, state):
    assert JobState.parse(text) == state


def test_finished_states():
    assert JobState.FAILED.finished and JobState.TIMEOUT.finished and JobState.COMPLETED.finished
    assert not JobState.RUNNING.finished and not JobState.PENDING.finished and not JobState.REQUEUED.finished


def test_json_numbers_across_openapi_versions():
    assert _json_int(768) == 768  # v0.0.38: a wait status
    assert _json_int({"set": True, "infinite": False, "number": 5}) == 5  # v0.0.39+
    assert _json_int({"set": False, "number": 0}) is None
    assert (
        _json_int(
            {
                "status": ["ERROR"],
                "return_code": {"set": True, "number": 3},
                "signal": {"id": {"set": True, "number": 0}},
            }
        )
        == 3 << 8
    )
    assert slurm._split_exit(768) == (3, 0)
    assert slurm._split_exit(9) == (0, 9)
    # As 22.05's job_state string: the flags that mean "not over yet" before the base state.
    assert _json_state(["FAILED", "REQUEUED"]) == "REQUEUED"
    assert _json_state(["CANCELLED", "COMPLETING"]) == "COMPLETING"
    assert _json_state(["RUNNING", "SIGNALING"]) == "RUNNING"
    assert _json_state("RUNNING") == "RUNNING"


def test_auto_backend_is_cli_without_pyslurm(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # makes `import pyslurm` raise ImportError
    module, why = slurm.pyslurm_status()
    assert module is None and "not installed" in why
    assert isinstance(slurm.get_backend("auto"), CliBackend)
    with pytest.raises(SlurmError, match="pyslurm backend is unavailable: pyslurm is not installed"):
        slurm.get_backend("pyslurm")


def test_mismatched_pyslurm_is_refused(monkeypatch):
    # PyPI's pyslurm (25.11) against this machine's Slurm (22.05) is exactly this case.
    fake = types.ModuleType("pyslurm")
    fake.__version__ = "25.11.2"
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    monkeypatch.setattr(slurm, "slurm_version", lambda: (22, 5))
    module, why = slurm.pyslurm_status()
    assert module is None
    assert (
        why
        == "pyslurm 25.11.2 is built for Slurm 25.11, the cluster runs 22.05: install a matching pyslurm or use the CLI backend"
    )
    assert isinstance(slurm.get_backend("auto"), CliBackend)


def test_auto_backend_is_cli_even_with_a_matching_pyslurm(monkeypatch):
    """pyslurm is opt-in: a matching build installed must not change what `auto` picks."""
    fake = types.ModuleType("pyslurm")
    fake.__version__ = "22.5.0"
    fake.JobSubmitDescription = object
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    monkeypatch.setattr(slurm, "slurm_version", lambda: (22, 5))
    assert slurm.pyslurm_status()[0] is fake
    assert isinstance(slurm.get_backend("auto"), CliBackend)
    assert isinstance(slurm.get_backend(), CliBackend)
    chosen = slurm.get_backend("pyslurm")
    assert isinstance(chosen, slurm.PyslurmBackend) and chosen.pyslurm is fake


class _PyslurmJob:
    """pyslurm 23.02+'s Job, reduced to the attributes hpkit reads, under pyslurm's own names
    (pyslurm/core/job/job.pyx: allocated_nodes, not nodes; exit_code and exit_code_signal split)."""

    loaded: ClassVar[dict[int, dict]] = {}
    cancelled: ClassVar[list[int]] = []

    def __init__(self, job_id: int):
        self.id = job_id

    @classmethod
    def load(cls, job_id: int):
        if job_id not in cls.loaded:
            raise RuntimeError("Invalid job id specified")  # pyslurm raises its RPCError here
        job = cls(job_id)
        job.__dict__.update(cls.loaded[job_id])
        return job

    def cancel(self) -> None:
        self.cancelled.append(self.id)


def test_pyslurm_backend_maps_pyslurms_job_fields():
    fake = types.ModuleType("pyslurm")
    fake.Job = _PyslurmJob
    _PyslurmJob.loaded[42] = {
        "name": "llama",
        "state": "FAILED",
        "exit_code": 3,
        "exit_code_signal": 0,
        "state_reason": "NonZeroExitCode",
        "allocated_nodes": "node[1-2]",
        "standard_output": "/fsx/logs/llama-42.out",
    }
    backend = slurm.PyslurmBackend(fake)
    info = backend.info("42")
    assert (info.name, info.state, info.exit_code, info.nodes, info.stdout) == (
        "llama",
        JobState.FAILED,
        3,
        "node[1-2]",
        "/fsx/logs/llama-42.out",
    )
    with pytest.raises(SlurmError, match="job 7: Invalid job id"):
        backend.info("7")
    backend.cancel("42")
    assert _PyslurmJob.cancelled == [42]


def test_missing_slurm_tools_say_what_to_do(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SlurmError, match="sbatch not found: run on a Slurm login node"):
        CliBackend().submit(__import__("pathlib").Path("x.sbatch"))
