"""`hpkit why` on what the real supervisor leaves: its events file and its log, read through why_gather.

The supervisor (hpkit.supervise.machine) runs against the scripted cluster of test_supervise.py and writes
its lines into the job's log, as the batch script's stdout; the steps write theirs there too. `why` must give
the same verdicts when every line the supervisor prints is worded otherwise: it reads the events, not them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_supervise import JOB, FakeCluster, StepScript, hang_at, plan

from hpkit.jobs import why
from hpkit.jobs.why_gather import gather
from hpkit.supervise.cluster import TaskExit
from hpkit.supervise.machine import Supervisor
from hpkit.supervise.plan import Run


def reworded(text: str) -> str:
    """Every word of a supervisor line changed: no sentence of the plain wording survives."""
    return "supervisor says: " + " ".join(word[::-1].upper() for word in text.split())


class Job:
    """One job's folder: the log every run appends to, the supervisor's files beside it, hpkit submit's note."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.out = root / "logs"
        self.out.mkdir(parents=True)
        self.log = self.out / f"t-{JOB}.out"
        self.log.touch()
        script = self.out / "t.sbatch"
        script.write_text(f"#!/bin/bash\n#SBATCH --job-name=t\n#SBATCH --output={self.out}/%x-%j.out\n")
        state = root / "state"
        (state / "jobs").mkdir(parents=True)
        note = {"job_id": JOB, "name": "t", "script": str(script), "workdir": str(root)}
        (state / "jobs" / f"{JOB}.json").write_text(json.dumps(note))
        monkeypatch.setenv("HPKIT_STATE_DIR", str(state))
        monkeypatch.setenv("PATH", str(root / "no-slurm"))  # no Slurm here: the files speak
        self.root = root

    def write(self, text: str) -> None:
        with open(self.log, "a") as log:
            log.write(text + "\n")

    def supervise(
        self, steps: list[StepScript], restart: int, say: Callable[[str], str], **plan_fields
    ) -> int:
        run = Run(job_id=JOB, restart=restart, nodelist="node[1-2]", batch_host="node1", cwd=self.root)
        sup = Supervisor(
            plan(**{"launcher": "srun", **plan_fields}),
            run,
            FakeCluster(steps),
            [],
            "train",
            {},
            lambda line: self.write(say(line)),
            self.root / "usr1",
        )
        sup.logs = lambda: {str(self.log.resolve()): self.log.stat().st_size}
        return sup.run()


def prints(job: Job, *lines: str) -> Callable[[int], None]:
    return lambda _attempt: [job.write(line) for line in lines]


def scenarios(job: Job, say: Callable[[str], str]) -> None:
    """Run 0: a hang, restarted in the allocation; then USR1 and hpkit's requeue. Run 1: rank 1 exits 3."""
    flag = job.root / "usr1"

    def hang_then_print(attempt: int) -> None:
        hang_at(job.root, restart=0)(attempt)
        job.write("0: hpkit: hang: rank 1 on node2 held up step 5; stacks of every rank in /x")

    job.supervise(
        [
            StepScript(exit=75, on_start=hang_then_print),
            StepScript(exit=0, polls=3, exit_on_usr1=0, on_start=lambda _: flag.touch()),
        ],
        0,
        say,
    )
    flag.unlink()
    job.supervise(
        [
            StepScript(
                exit=3,
                tasks=[TaskExit("node2", "1", "Exited with exit code 3")],
                on_start=prints(job, "srun: error: node2: task 1: Exited with exit code 3"),
            )
        ],
        1,
        say,
    )


def verdict(job: Job) -> why.Verdict:
    facts = gather(JOB)
    # No Slurm here: the job's state comes from its files alone.
    return why.decide(
        why.Facts(facts.job_id, [why.SlurmRecord("test", "FAILED", restarts=1)], facts.findings)
    )


def test_why_reads_the_events_not_the_supervisors_lines(tmp_path, monkeypatch):
    plain = Job(tmp_path / "plain", monkeypatch)
    scenarios(plain, lambda line: line)
    other = Job(tmp_path / "other", monkeypatch)
    scenarios(other, reworded)
    assert "hpkit: requeueing job" in plain.log.read_text()
    assert not [line for line in other.log.read_text().splitlines() if line.startswith("hpkit: ")]

    monkeypatch.setenv("HPKIT_STATE_DIR", str(plain.root / "state"))
    first = verdict(plain)
    monkeypatch.setenv("HPKIT_STATE_DIR", str(other.root / "state"))
    second = verdict(other)
    # Run 1 failed by itself: neither run 0's hang (restarted) nor its requeue is the verdict.
    assert (first.kind, first.rank, first.summary) == (
        why.PROGRAM_ERROR,
        1,
        "program error on rank 1: exit code 3, no traceback",
    )
    assert (second.kind, second.rank, second.node, second.summary) == (
        first.kind,
        first.rank,
        first.node,
        first.summary,
    )


def test_a_preempted_run_is_named_from_the_events_in_either_wording(tmp_path, monkeypatch):
    summaries = []
    for name, say in (("plain", lambda line: line), ("other", reworded)):
        job = Job(tmp_path / name, monkeypatch)
        flag = job.root / "usr1"
        job.supervise(
            [StepScript(exit=0, polls=3, exit_on_usr1=0, on_start=lambda _, f=flag: f.touch())], 0, say
        )
        facts = gather(JOB)
        v = why.decide(why.Facts(JOB, [why.SlurmRecord("test", "PENDING", restarts=1)], facts.findings))
        assert v.kind == why.PREEMPTED, v
        summaries.append(v.summary)
    assert summaries[0] == summaries[1] and summaries[0].startswith("preempted and requeued (restart 1 of 2)")


def test_why_reads_an_overlong_line_only_up_to_its_bound_and_goes_on_after_it(tmp_path, monkeypatch):
    # A job's output of binary garbage without a newline was read whole, as one line (a GB of memory for a GB of
    # output); now a line is held up to MAX_LINE_CHARS, its rest skipped, and the lines after it read as usual.
    from hpkit.jobs import why_gather

    monkeypatch.setattr(why_gather, "MAX_LINE_CHARS", 1000)
    log = tmp_path / "job.out"
    log.write_text("x" * 10_500 + "\nTraceback (most recent call last):\n" + "y" * 999 + "\nend\n")
    lines = list(why_gather._Reader(None).lines(log, "job output"))
    assert [len(line) for line in lines] == [1000, len("Traceback (most recent call last):\n"), 999 + 1, 4]
    assert lines[1] == "Traceback (most recent call last):\n" and lines[3] == "end\n"


def test_the_last_steps_first_line_is_counted_as_the_scan_reads_lines(tmp_path):
    # The scan reads universal newlines (a progress bar's lone "\r" ends a line); the step's first line was counted
    # over "\n" alone, so in a log with "\r"s the scan began in the step before.
    import os
    from types import SimpleNamespace

    from hpkit.jobs import why_gather

    log = tmp_path / "job.out"
    before = "step 1\rstep 2\rstep 3\r\nsrun: error: node2: task 1: Exited with exit code 3\n"
    log.write_bytes((before + "the last step begins\r\nend\n").encode())
    events = SimpleNamespace(logs={os.path.realpath(log): len(before.encode())})
    lines = list(why_gather._Reader(None).lines(log, "job output"))
    start = why_gather._start_line(log, events)
    assert lines[start - 1] == "the last step begins\n", (start, lines)
    # Without a recorded size, or past the file's end (a file cut short), the scan reads it all.
    assert why_gather._start_line(log, SimpleNamespace(logs={})) == 1
    assert why_gather._start_line(log, SimpleNamespace(logs={os.path.realpath(log): 10**9})) == 1
