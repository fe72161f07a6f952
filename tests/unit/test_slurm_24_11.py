"""hpkit's Slurm readers against real records of Slurm 24.11.5 (HyperPod's Slurm; data_parser v0.0.42).

The records in tests/fixtures/slurm-24.11 were captured from `make cluster-up SLURM=24.11` (see the README
there): every shape that hpkit.slurm reads, with the states a job goes through.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest

from hpkit import slurm
from hpkit.slurm import CliBackend, JobState, client, parse_scontrol_record

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-24.11"


def records(name: str) -> dict[str, dict]:
    data = json.loads((FIXTURES / name).read_text())
    assert data["meta"]["slurm"]["release"] == "24.11.5"
    assert data["meta"]["plugin"]["data_parser"] == "data_parser/v0.0.42"
    return {str(job["job_id"]): job for job in data["jobs"]}


def info(name: str, job_id: str) -> slurm.JobInfo:
    return CliBackend()._from_record(records(name)[job_id], with_stdout=False)


@pytest.mark.parametrize(
    ("job_id", "state", "exit_code", "signal", "reason", "nodes"),
    [
        ("9001", JobState.COMPLETED, 0, 0, "None", "node[1-2]"),
        ("9002", JobState.FAILED, 3, 0, "NonZeroExitCode", "node1"),  # exit 3
        ("9003", JobState.FAILED, 0, 9, "RaisedSignal", "node2"),  # kill -9: no return code, signal 9
        ("9004", JobState.TIMEOUT, 0, 15, "TimeLimit", "node1"),
        ("9005", JobState.PENDING, 0, 0, "JobHeldUser", ""),  # scontrol requeuehold of a running job
        ("9006", JobState.CANCELLED, 0, 15, "None", "node1"),  # scancel
        ("9007", JobState.RUNNING, 0, 0, "None", "node1"),  # its second run, after scontrol requeue
        ("9008", JobState.PENDING, 0, 0, "BeginTime", ""),
    ],
)
def test_every_state_of_squeue_json(job_id, state, exit_code, signal, reason, nodes):
    """`squeue --json --states=all`: states as lists, numbers as {set, infinite, number}, exit codes as
    {status, return_code, signal}."""
    job = info("squeue-states-all.json", job_id)
    assert (job.state, job.exit_code, job.signal, job.reason, job.nodes) == (
        state,
        exit_code,
        signal,
        reason,
        nodes,
    )
    assert job.user == "root" and job.node_count == (2 if job_id == "9001" else 1)


def test_a_failed_and_a_signalled_job_read_as_22_05s_wait_status_would():
    failed = info("squeue-states-all.json", "9002")
    assert failed.summary() == "job 9002 (fail): FAILED, exit code 3, reason NonZeroExitCode, on node1"
    killed = info("squeue-states-all.json", "9003")
    assert killed.summary() == "job 9003 (sig): FAILED, exit code 0, signal 9, reason RaisedSignal, on node2"


def test_times_and_limits():
    demo = info("squeue-states-all.json", "9000")
    assert demo.time_limit_min == 15 and demo.end_time - demo.start_time == 51  # the demo job, 51 s
    assert info("squeue-states-all.json", "9004").time_limit_min == 1
    # An unlimited job: {"set": false, "infinite": true}
    assert records("squeue-states-all.json")["9008"]["time_limit"] == {
        "set": False,
        "infinite": True,
        "number": 0,
    }
    assert info("squeue-states-all.json", "9008").time_limit_min is None


def test_running_and_requeued_jobs():
    running = info("squeue-active.json", "9005")
    assert (running.state, running.nodes, running.reason) == (JobState.RUNNING, "node2", "None")
    requeued = records("squeue-active.json")["9007"]  # just after `scontrol requeue`
    assert requeued["restart_cnt"] == 1
    assert info("squeue-active.json", "9007").state == JobState.PENDING


def test_a_job_whose_steps_are_still_being_killed_is_completing_not_ended():
    """24.11 lists ["CANCELLED", "COMPLETING"] while the steps die; 22.05 said COMPLETING. `wait` must not
    return before the steps are gone."""
    raw = records("squeue-completing.json")
    assert raw["9009"]["job_state"] == ["CANCELLED", "COMPLETING"]
    assert raw["9010"]["job_state"] == ["PENDING", "COMPLETING"]  # requeued, its old run still ending
    for job_id in ("9009", "9010"):
        job = info("squeue-completing.json", job_id)
        assert job.state == JobState.COMPLETING and not job.state.finished


def test_stdout_is_the_expanded_path_without_asking_scontrol(monkeypatch):
    """24.11 gives the expanded output path (`-o logs/%x-%j.out` in the submit directory)."""
    monkeypatch.setattr(client, "run", lambda *a, **k: pytest.fail(f"no Slurm call expected: {a}"))
    record = records("squeue-states-all.json")["9001"]
    assert CliBackend()._stdout(record) == "/tmp/hpkit-u/cap/logs/ok-9001.out"


class FakeSlurm:
    """client.run answering from the captured outputs; records each command."""

    def __init__(self, squeue: str | None, sacct_c: str = ""):
        self.calls: list[list[str]] = []
        self.squeue = squeue
        self.sacct_c = sacct_c

    def __call__(self, args, env=None, check=True, timeout_s=None):
        self.calls.append(args)
        done = lambda rc, out="", err="": subprocess.CompletedProcess(args, rc, out, err)  # noqa: E731
        if args[:2] == ["sinfo", "--version"]:
            return done(0, (FIXTURES / "sinfo-version.txt").read_text())
        if args[0] == "squeue":
            if self.squeue is None:  # the one job named has left the controller
                return done(1, "", (FIXTURES / "squeue-unknown-job.stderr").read_text())
            return done(0, self.squeue)
        if args[0] == "sacct" and "-c" in args:
            return done(0, self.sacct_c)
        if args[0] == "sacct":  # no slurmdbd on the local cluster
            return done(1, "", "Slurm accounting storage is disabled\n")
        raise AssertionError(args)


def test_version_and_the_squeue_call(monkeypatch):
    fake = FakeSlurm((FIXTURES / "squeue-states-all.json").read_text())
    monkeypatch.setattr(client, "run", fake)
    backend = CliBackend()
    assert backend.version == (24, 11)
    found = backend.poll(["9002", "9001"])
    # Ended jobs are asked for by state: without --states=all, 24.11 leaves them out even when named.
    assert fake.calls[-1] == ["squeue", "--json", "--states=all", "--jobs=9002,9001"]
    assert found["9002"].state == JobState.FAILED and found["9001"].state == JobState.COMPLETED


def test_a_forgotten_job_is_read_from_the_completion_log(monkeypatch):
    """squeue exits 1 for a single unknown job; sacct without slurmdbd fails; `sacct -c` answers."""
    fake = FakeSlurm(None, (FIXTURES / "sacct-completion-log.txt").read_text())
    monkeypatch.setattr(client, "run", fake)
    monkeypatch.setattr(client, "has_sacct", lambda env=None: True)
    found = CliBackend().poll(["9003"])
    assert [c[:2] for c in fake.calls[1:]] == [["squeue", "--json"], ["sacct", "--json"], ["sacct", "-c"]]
    job = found["9003"]
    assert (job.state, job.exit_code, job.signal, job.nodes) == (JobState.FAILED, 0, 9, "node2")


def test_the_completion_log_lines():
    fake = FakeSlurm(None, (FIXTURES / "sacct-completion-log.txt").read_text())
    rows = {line.split("|")[0]: line.split("|") for line in fake.sacct_c.splitlines()}
    assert rows["9004"][2:4] == ["TIMEOUT", "0:0"] and rows["9006"][2:4] == ["CANCELLED", "0:0"]
    assert JobState.parse(rows["9004"][2]) == JobState.TIMEOUT


def test_scontrol_show_job_record():
    fields = parse_scontrol_record((FIXTURES / "scontrol-show-job-signaled.txt").read_text().strip())
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "0:9"
    assert fields["Reason"] == "RaisedSignal:9(Killed)"
    assert fields["StdOut"] == "/tmp/hpkit-u/cap/sig-9003.out"
    assert fields["NodeList"] == "node2" and fields["Restarts"] == "0"


def test_sinfo_node_states(monkeypatch):
    text = (FIXTURES / "sinfo-nodes.txt").read_text()
    monkeypatch.setattr(
        client, "call", lambda args, env=None, timeout_s=None: client.Answer(tuple(args), 0, text)
    )
    assert slurm.node_states() == {"node1": "mix", "node2": "idle"}


def test_the_job_completion_log():
    """jobcomp/filetxt (read by `hpkit why`): one line per run; 24.11 logs a requeued run as PENDING."""
    from hpkit.jobs.why_scan import scan_jobcomp

    lines = (FIXTURES / "jobcomp.txt").read_text().splitlines()
    (killed,) = scan_jobcomp(lines, "jobcomp", "9003")
    assert (killed.state, killed.exit_code, killed.nodes, killed.name) == ("FAILED", "0:9", "node2", "sig")
    first, second = scan_jobcomp(lines, "jobcomp", "9007")
    assert (first.state, first.restarts) == ("REQUEUED", None)  # ended by `scontrol requeue` (logged PENDING)
    assert (second.state, second.restarts) == ("CANCELLED", 1)
    (timed_out,) = scan_jobcomp(lines, "jobcomp", "9004")
    assert (timed_out.state, timed_out.time_limit) == ("TIMEOUT", "1")


def test_why_reads_a_run_that_24_11_logged_as_pending_as_requeued():
    # `scontrol requeue` of job 9007: the completion log's line for the run it ended says JobState=PENDING.
    # `hpkit why` took it for a job still pending ("not ended: PENDING") once slurmctld had forgotten the job.
    from hpkit.jobs.why import NOT_ENDED, Facts, decide
    from hpkit.jobs.why_scan import scan_jobcomp

    lines = [
        line for line in (FIXTURES / "jobcomp.txt").read_text().splitlines() if "JobState=PENDING" in line
    ]
    (requeued,) = scan_jobcomp([lines[0]], "jobcomp", "9007")  # the log as it was before the job's next run
    verdict = decide(Facts("9007", [requeued], []))
    assert (verdict.kind, verdict.state) == (NOT_ENDED, "REQUEUED")
    assert verdict.summary.startswith("requeued: Slurm requeued the job's last run"), verdict.summary
    assert "JobState=PENDING" in verdict.evidence[0].text  # the record it rests on, as Slurm wrote it


# --- OCI containers with launcher: srun, by the cluster's version (`sinfo --version` at submit) -------------------


def _oci_job(launcher: str = "srun"):
    from hpkit.slurm.job import SlurmJob
    from hpkit.validation import parse_document

    data = {
        "name": "j",
        "launcher": launcher,
        "tasks_per_node": 2,
        "container": {"runtime": "oci", "image": "/b"},
    }
    return parse_document(SlurmJob, data, "job.yaml")


def _sinfo_prints(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, status: int = 0) -> None:
    sinfo = tmp_path / "sinfo"
    sinfo.write_text(f"#!/bin/sh\nprintf '%s\\n' '{text}'\nexit {status}\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")


def test_oci_srun_launcher_runs_on_24_11(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hpkit.slurm.job import oci_launcher_problem

    _sinfo_prints(
        monkeypatch, tmp_path, (FIXTURES / "sinfo-version.txt").read_text().strip()
    )  # slurm-wlm 24.11.5
    assert oci_launcher_problem(_oci_job(), slurm.slurm_version) is None


def test_oci_srun_launcher_is_refused_on_22_05_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hpkit.slurm.job import oci_launcher_problem

    _sinfo_prints(monkeypatch, tmp_path, "slurm-wlm 22.05.8")  # the host's Debian 12 sinfo --version
    problem = oci_launcher_problem(_oci_job(), slurm.slurm_version)
    assert problem is not None and problem.startswith(
        "launcher: srun cannot run in container.runtime oci on Slurm 22.05"
    )
    assert "launcher: torchrun" in problem and "\n" not in problem
    # torchrun never asks the version: a cluster that does not answer changes nothing.
    assert oci_launcher_problem(_oci_job("torchrun"), lambda: pytest.fail("the version was read")) is None


def test_oci_srun_launcher_without_a_version_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hpkit.slurm.job import oci_launcher_problem

    _sinfo_prints(monkeypatch, tmp_path, "sinfo: error: Could not establish a configuration source", status=1)
    problem = oci_launcher_problem(_oci_job(), slurm.slurm_version)
    assert problem is not None and "could not be read" in problem and "sinfo --version" in problem


def test_oci_mpi_launcher_is_refused_by_the_spec() -> None:
    from hpkit.errors import SpecError

    with pytest.raises(SpecError, match=r"launcher: mpi cannot run in container.runtime oci"):
        _oci_job("mpi")


# --- Preemption: a preempted job that Slurm requeues is neither ended nor failed -------------------------------


def _preempted(job_id: str, requeue: bool, shape: str) -> dict:
    """The captured running job 9005 as the controller lists it once preempted: 24.11's state list, or 22.05's
    string (data_parser v0.0.38); `requeue` is the job's flag (sbatch --requeue / --no-requeue)."""
    record = json.loads(json.dumps(records("squeue-active.json")["9005"]))
    record.update(job_id=int(job_id), requeue=requeue)
    record["job_state"] = ["PREEMPTED"] if shape == "24.11" else "PREEMPTED"
    return record


def _with_state(record: dict, state: str) -> dict:
    return {**record, "job_state": [state]}


@pytest.mark.parametrize("shape", ["24.11", "22.05"])
def test_a_preempted_job_that_slurm_requeues_is_not_ended_nor_failed(shape):
    backend = CliBackend()
    requeued = backend._from_record(_preempted("9105", True, shape), with_stdout=False)
    assert requeued.state == JobState.PREEMPTED and requeued.requeued and not requeued.ended
    assert requeued.summary() == "job 9105 (running): PREEMPTED (requeued), on node2"
    dropped = backend._from_record(_preempted("9106", False, shape), with_stdout=False)
    assert dropped.ended and not dropped.requeued
    assert dropped.summary().startswith("job 9106 (running): PREEMPTED (not requeued), exit code 0")


def test_the_scontrol_record_of_a_preempted_job_names_its_requeue_flag():
    """`scontrol show job -o` of the same preempted job: JobState=PREEMPTED, and Requeue=1 (what squeue's JSON
    calls `requeue`), read by the same parser as every scontrol record."""
    line = (FIXTURES / "scontrol-show-job-signaled.txt").read_text().strip()
    line = line.replace("JobState=FAILED", "JobState=PREEMPTED").replace("Restarts=0", "Restarts=1")
    fields = parse_scontrol_record(line)
    assert JobState.parse(fields["JobState"]) == JobState.PREEMPTED
    assert fields["Requeue"] in ("0", "1") and fields["Restarts"] == "1"


class SqueueSequence(FakeSlurm):
    """squeue answering one captured-shape document per call, in order (the last one repeats)."""

    def __init__(self, documents: list[list[dict]]):
        super().__init__(None)
        self.documents = documents

    def __call__(self, args, env=None, check=True):
        if args[0] == "squeue":
            self.calls.append(args)
            jobs = self.documents[min(len(self.squeues()) - 1, len(self.documents) - 1)]
            meta = json.loads((FIXTURES / "squeue-active.json").read_text())["meta"]
            return subprocess.CompletedProcess(
                args, 0, json.dumps({"meta": meta, "jobs": jobs, "errors": []}), ""
            )
        return super().__call__(args, env, check)

    def squeues(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] == "squeue"]


class VirtualTime:
    """wait_all's clock and sleep: time moves only when it sleeps (no wall clock in unit tests)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_waits_on_through_a_requeued_preemption(monkeypatch):
    """PREEMPTED (requeued) -> PENDING -> RUNNING -> COMPLETED: wait returns the completion, exit status 0."""
    from hpkit.jobs.watch import exit_status

    preempted = _preempted("9105", True, "24.11")
    fake = SqueueSequence(
        [[_with_state(preempted, state)] for state in ("PREEMPTED", "PENDING", "RUNNING", "COMPLETED")]
    )
    monkeypatch.setattr(client, "run", fake)
    time = VirtualTime()
    seen: list[str] = []
    done = slurm.wait_all(
        CliBackend(),
        ["9105"],
        on_change=lambda info, _t: seen.append(info.state_text),
        clock=time.clock,
        sleep=time.sleep,
    )
    assert seen == ["PREEMPTED (requeued)", "PENDING", "RUNNING", "COMPLETED"]
    assert done["9105"].state == JobState.COMPLETED and exit_status(done) == 0
    assert len(fake.squeues()) == 4  # one call per poll


def test_wait_ends_on_a_preemption_without_requeue_and_says_so(monkeypatch):
    fake = SqueueSequence([[_preempted("9106", False, "24.11")]])
    monkeypatch.setattr(client, "run", fake)
    time = VirtualTime()
    done = slurm.wait_all(CliBackend(), ["9106"], clock=time.clock, sleep=time.sleep)
    assert done["9106"].state_text == "PREEMPTED (not requeued)" and len(fake.squeues()) == 1


def test_the_status_table_shows_a_requeued_preemption():
    from hpkit.jobs.status_table import format_table

    job = CliBackend()._from_record(_preempted("9105", True, "24.11"), with_stdout=False)
    _header, row = format_table([job], now=job.start_time + 100).splitlines()
    assert row.split()[:4] == ["9105", "running", "PREEMPTED", "(requeued)"] and "FAILED" not in row


def test_the_wait_interval_grows_while_nothing_changes_and_resets_on_a_change(monkeypatch):
    """Two jobs pending for 40 s, then one ends: polls 1 s apart for 10 s, then 2 s; the end resets to 1 s."""
    first = _with_state(_preempted("9201", True, "24.11"), "PENDING")
    second = _with_state(_preempted("9202", True, "24.11"), "PENDING")
    both = [first, second]
    fake = SqueueSequence([both] * 24 + [[_with_state(first, "COMPLETED"), second], [second]])
    monkeypatch.setattr(client, "run", fake)
    time = VirtualTime()
    polls: list[float] = []
    real_poll = CliBackend.poll

    def poll(self, job_ids):
        polls.append(time.now)
        return real_poll(self, job_ids)

    monkeypatch.setattr(CliBackend, "poll", poll)
    with pytest.raises(slurm.SlurmError, match="still running after 50 s: 9202 PENDING"):
        slurm.wait_all(CliBackend(), ["9201", "9202"], timeout_s=50, clock=time.clock, sleep=time.sleep)
    gaps = [round(b - a, 1) for a, b in itertools.pairwise(polls)]
    assert gaps[:10] == [1.0] * 10 and set(gaps[10:23]) == {2.0}
    ended = 24  # the 25th poll sees 9201 completed: the next gap is 1 s again
    assert gaps[ended] == 1.0, gaps
    # One squeue call per poll for both jobs.
    assert len(fake.squeues()) == len(polls)


def test_a_polls_records_locate_a_jobs_files_without_a_second_call(monkeypatch):
    """polled_fields: the last poll's squeue record in scontrol's words; (True, None) for a job that poll found
    forgotten; (False, None) for one it did not ask about (the caller then asks scontrol)."""
    fake = FakeSlurm((FIXTURES / "squeue-states-all.json").read_text())
    monkeypatch.setattr(client, "run", fake)
    monkeypatch.setattr(CliBackend, "_from_sacct", lambda self, job_ids: {})
    backend = CliBackend()
    backend.poll(["9000", "99999"])
    calls = len(fake.calls)
    asked, fields = slurm.polled_fields(backend, "9000")
    assert asked and fields == {
        "Command": "/work/main/logs/demo-20261127-130517-18c4.sbatch",
        "WorkDir": "/work/main",
        "Restarts": "0",
    }
    assert slurm.polled_fields(backend, "99999") == (True, None)
    assert slurm.polled_fields(backend, "9001") == (False, None)
    assert len(fake.calls) == calls  # read from the poll, not asked again
