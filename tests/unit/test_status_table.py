"""`hpkit status` without a job id: the table's cells, and the polling schedule."""

from __future__ import annotations

from hpkit.jobs.status_table import format_table, slurm_duration
from hpkit.slurm import JobInfo, JobState, poll_interval

NOW = 1_800_000_000


def test_durations_are_written_as_slurm_writes_them():
    assert [slurm_duration(s) for s in (None, 0, 59, 3600 + 61, 2 * 86400 + 5)] == [
        "-",
        "00:00:00",
        "00:00:59",
        "01:01:01",
        "2-00:00:05",
    ]


def test_table_rows_for_pending_running_and_finished_jobs():
    jobs = [
        JobInfo("7", "queued", JobState.PENDING, reason="Priority", node_count=4, time_limit_min=90),
        JobInfo(
            "8",
            "train",
            JobState.RUNNING,
            reason="None",
            nodes="node[1-2]",
            node_count=2,
            start_time=NOW - 125,
            end_time=NOW + 3475,
            time_limit_min=60,
        ),
        JobInfo(
            "9", "done", JobState.FAILED, nodes="node1", node_count=1, start_time=NOW - 50, end_time=NOW - 20
        ),
        JobInfo("10", "open", JobState.PENDING, reason="JobHeldUser", node_count=1, time_limit_min=None),
    ]
    lines = format_table(jobs, now=NOW).splitlines()
    assert [line.split() for line in lines] == [
        ["JOBID", "NAME", "STATE", "NODES", "ELAPSED", "TIME", "LEFT", "REASON"],
        ["7", "queued", "PENDING", "4", "-", "01:30:00", "Priority"],
        ["8", "train", "RUNNING", "2", "node[1-2]", "00:02:05", "00:57:55", "-"],
        ["9", "done", "FAILED", "1", "node1", "00:00:30", "-", "-"],
        ["10", "open", "PENDING", "1", "-", "UNLIMITED", "JobHeldUser"],
    ]
    assert format_table([], now=NOW) == "no jobs of yours in the queue"


def test_polls_back_off_as_a_job_ages():
    assert [poll_interval(a) for a in (0, 9, 10, 59, 60, 299, 300, 10_000)] == [1, 1, 2, 2, 5, 5, 10, 10]
    assert poll_interval(0, first_s=3) == 3 and poll_interval(400, first_s=30) == 30
