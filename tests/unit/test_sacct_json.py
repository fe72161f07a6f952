"""`sacct --json -D` of Slurm 22.05 and 24.11, captured from the local clusters with accounting
(tests/fixtures/sacct/capture.sh: a job in each end state, an array job, a job requeued after its node was lost
and one requeued by hand), read by hpkit.slurm.parse_sacct_json, and `hpkit why`'s verdict from each record.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hpkit.errors import SlurmError
from hpkit.jobs import why
from hpkit.jobs.why import Facts, decide
from hpkit.jobs.why_scan import scan_accounting
from hpkit.slurm import (
    AccountingUnavailable,
    JobAccounting,
    JobState,
    accounting,
    needs_text_exit_codes,
    parse_sacct_json,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sacct"
VERSIONS = ["22.05", "24.11"]

# name -> (the state of each run, oldest first; the last run's exit code)
RUNS = {
    "completed": (["COMPLETED"], 0),
    "failed": (["FAILED"], 3),
    "timeout": (["TIMEOUT"], 0),
    "cancelled": (["CANCELLED"], 0),
    "node_fail": (["NODE_FAIL"], None),
    "preempted": (["PREEMPTED"], 0),
    "requeued": (["NODE_FAIL", "COMPLETED"], 0),
    "requeued_by_hand": (["REQUEUED", "COMPLETED"], 0),
}


def read(version: str, name: str) -> dict[str, JobAccounting]:
    """As hpkit.slurm.accounting reads it: on 22.05 with the exit codes from sacct's text output."""
    text = (FIXTURES / version / f"{name}.json").read_text()
    codes = (
        (FIXTURES / version / f"{name}.exitcodes.txt").read_text() if needs_text_exit_codes(text) else None
    )
    return parse_sacct_json(text, codes)


def job(version: str, name: str) -> JobAccounting:
    found = read(version, name)
    assert len(found) == 1, found.keys()
    return next(iter(found.values()))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_end_state_and_its_runs(version, name):
    states, code = RUNS[name]
    got = job(version, name)
    assert [r.state.value for r in got.runs] == states
    assert got.requeues == len(states) - 1
    assert got.job_id.isdigit() and got.last.name == name
    if code is not None:
        assert got.last.exit_code == code
    for run in got.runs:  # every run started somewhere, and says where and for how long
        assert run.nodes and run.nodes != "None assigned" and run.start_time and run.end_time
        assert run.elapsed_s is not None and run.elapsed_s >= 0
        assert run.workdir.startswith("/")
        assert {s.step for s in run.steps} >= {"batch", "0"}
    info = got.info()
    assert info.state == JobState(states[-1]) and info.state.finished and info.job_id == got.job_id


@pytest.mark.parametrize("version", VERSIONS)
def test_exit_codes_per_step(version):
    failed = {s.step: s for s in job(version, "failed").last.steps}
    assert (failed["0"].state, failed["0"].exit_code) == (JobState.FAILED, 3)
    assert (failed["batch"].state, failed["batch"].exit_code) == (JobState.FAILED, 3)
    cancelled = {s.step: s for s in job(version, "cancelled").last.steps}
    assert cancelled["0"].state == JobState.CANCELLED and cancelled["0"].signal == 15
    assert job(version, "cancelled").last.cancelled_by == "root"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_step_killed_over_its_memory_is_signal_9(version):
    """jobacct_gather's OverMemoryKill (no cgroup) kills the step with SIGKILL: Slurm says FAILED, not
    OUT_OF_MEMORY (that state needs the cgroup's OOM record, which this host's clusters do not have)."""
    got = job(version, "out_of_memory")
    assert got.last.state == JobState.FAILED
    step = {s.step: s for s in got.last.steps}["0"]
    assert step.state == JobState.CANCELLED and step.signal == 9


@pytest.mark.parametrize("version", VERSIONS)
def test_an_array_job_gives_each_task(version):
    found = read(version, "array")
    tasks = sorted(found)
    assert [t.rsplit("_", 1)[1] for t in tasks] == ["0", "1", "2"]
    assert len({t.split("_")[0] for t in tasks}) == 1
    assert [(found[t].last.state, found[t].last.exit_code) for t in tasks] == [
        (JobState.COMPLETED, 0),
        (JobState.FAILED, 1),
        (JobState.FAILED, 2),
    ]


def test_the_node_of_each_run_is_kept():
    for version in VERSIONS:
        runs = job(version, "requeued").runs
        assert all(r.nodes for r in runs) and runs[0].end_time <= runs[1].start_time


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("name", "kind", "summary"),
    [
        ("completed", why.COMPLETED, "completed"),
        ("requeued", why.COMPLETED, "completed after 1 restart(s)"),
        ("requeued_by_hand", why.COMPLETED, "completed after 1 restart(s)"),
        ("failed", why.PROGRAM_ERROR, "program error: the job script exited with 3"),
        ("timeout", why.TIME_LIMIT, None),
        ("node_fail", why.NODE_FAILURE, None),
        ("preempted", why.PREEMPTED, None),
        ("cancelled", why.CANCELLED, "cancelled by root (uid 0)"),
    ],
)
def test_why_from_accounting_alone(version, name, kind, summary):
    """What `hpkit why` says of a job the controller has forgotten, from accounting's record only."""
    got = job(version, name)
    record, findings = scan_accounting(got, f"sacct --json -D -j {got.job_id}")
    verdict = decide(Facts(got.job_id, [record], findings), name_of={0: "root"}.get)
    assert verdict.kind == kind, verdict.summary
    if summary is not None:
        assert verdict.summary.startswith(summary), verdict.summary
    assert verdict.state == got.last.state.value
    # The runs are cited, the last first, each with its state and nodes.
    texts = [e.text for e in verdict.evidence if e.source.startswith("sacct")]
    assert texts[0].startswith(f"run {len(got.runs)} of {len(got.runs)}: {got.last.state.value} on ")


def test_22_05_json_exit_codes_are_all_0_and_the_text_is_read_instead():
    """Why `accounting` asks 22.05 a second time: its JSON says SUCCESS, 0 for a job that exited 3."""
    text = (FIXTURES / "22.05" / "failed.json").read_text()
    assert needs_text_exit_codes(text)
    assert not needs_text_exit_codes((FIXTURES / "24.11" / "failed.json").read_text())
    alone = next(iter(parse_sacct_json(text).values())).last
    assert alone.state == JobState.FAILED and alone.exit_code == 0
    assert job("22.05", "failed").last.exit_code == 3


def test_unreadable_json_is_one_error():
    with pytest.raises(SlurmError, match="no JSON"):
        parse_sacct_json("sacct: error: Problem talking to the database")


def _conf(tmp_path: Path, storage: str) -> dict[str, str]:
    path = tmp_path / "slurm.conf"
    path.write_text(
        f"ClusterName=x\nSlurmctldHost=localhost\n{storage}\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
    )
    return {**os.environ, "SLURM_CONF": str(path)}


@pytest.mark.skipif(shutil.which("sacct") is None, reason="needs Slurm's sacct (slurm-client)")
def test_a_cluster_without_accounting_is_told_from_a_slurmdbd_that_does_not_answer(tmp_path):
    """The real sacct: accounting_storage/none is AccountingUnavailable (status and wait go to the completion log
    for good); a slurmdbd that refuses the connection is a SlurmError (asked again at the next poll)."""
    with pytest.raises(AccountingUnavailable, match="accounting storage is disabled"):
        accounting(["1"], _conf(tmp_path, "AccountingStorageType=accounting_storage/none"))
    down = "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\nAccountingStoragePort=1"
    with pytest.raises(SlurmError) as raised:
        accounting(["1"], _conf(tmp_path, down))
    assert not isinstance(raised.value, AccountingUnavailable) and "Connection refused" in str(raised.value)
