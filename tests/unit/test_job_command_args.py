"""The job commands refuse a malformed job id or a timing flag that is not a positive number in one line, before
they ask Slurm anything (no cluster here: a command that reached Slurm would fail another way)."""

from __future__ import annotations

import pytest

from hpkit import cli

NOT_AN_ID = "is not a Slurm job id (a number such as 1234), or JOB_TASK for a task of a job array (1234_5)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["status", "abc"], f"argument job_id: 'abc' {NOT_AN_ID}"),
        (["logs", "12;rm"], f"argument job_id: '12;rm' {NOT_AN_ID}"),
        (["cancel", ""], f"argument job_id: '' {NOT_AN_ID}"),
        (["why", "1_2_3"], f"argument job_id: '1_2_3' {NOT_AN_ID}"),
        (
            ["why", "\u0663\u0660"],
            f"argument job_id: '\u0663\u0660' {NOT_AN_ID}",
        ),  # Arabic-Indic digits: int() reads them
        (["wait", "1", "x"], f"argument job_id: 'x' {NOT_AN_ID}"),
        (["wait", "1", "--poll", "-1"], "argument --poll: must be greater than 0"),
        (["wait", "1", "--poll", "nan"], "argument --poll: must be a finite number"),
        (["wait", "1", "--timeout", "-5"], "argument --timeout: must be greater than 0"),
        (
            ["submit", "spec.yaml", "--outage-timeout", "inf"],
            "argument --outage-timeout: must be a finite number",
        ),
    ],
)
def test_a_bad_job_id_or_timing_flag_is_one_usage_line(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"hpkit {argv[0]}: error: {message}", err


def test_a_job_task_and_spaces_around_an_id_are_accepted():
    from hpkit.arg_types import job_id

    assert job_id(" 1234_5 ") == "1234_5" and job_id("77") == "77"


def test_a_path_a_command_cannot_write_is_one_line_not_a_traceback(tmp_path, capsys):
    """An OSError (a folder that cannot be made, a full disk) reaches the user as the system's one line, naming the
    path; it was a traceback (`hpkit data prepare --out /proc/x`, `hpkit import-sagemaker -o /proc/x.yaml`)."""
    described = tmp_path / "estimator.json"
    described.write_text(
        '{"entry_point": "train.py", "instance_type": "ml.p4d.24xlarge", "instance_count": 2}'
    )
    assert cli.main(["import-sagemaker", str(described), "-o", "/proc/no-such/spec.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "hpkit import-sagemaker: error: [Errno 2] No such file or directory: '/proc/no-such"
    )
    assert err.count("\n") == 1, err
