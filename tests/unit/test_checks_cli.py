"""The runner, the report and `hpkit check`'s options and exit codes."""

from __future__ import annotations

import io
import json
import sys
import threading
from pathlib import Path

import pytest
from _imds_server import closed_port

from hpkit.checks import registry, report, runner
from hpkit.checks.context import PROFILES, Context
from hpkit.checks.registry import Check
from hpkit.checks.result import Result, Status
from hpkit.commands import check


@pytest.fixture(autouse=True)
def _never_real_imds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", closed_port())
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = check.main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_profiles() -> None:
    login = {c.name for c in registry.for_profile("login")}
    assert login == {
        "python",
        "imds",
        "slurm",
        "topology",
        "pyxis",
        "container-runs",
        "enroot",
        "shared-fs",
        "disk",
    }
    assert not login & {"gpus", "cuda", "torch", "efa", "nccl"}  # a login node needs no GPU
    assert "var-log-mount" in {c.name for c in registry.for_profile("container")}
    assert "var-log-mount" not in {c.name for c in registry.for_profile("compute")}
    assert all(set(c.profiles) <= set(PROFILES) for c in registry.all_checks().values())


@pytest.mark.parametrize("profile", PROFILES)
def test_every_finding_on_this_machine_says_how_to_fix_it(
    profile: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report_ = run_json(capsys, "--profile", profile)
    assert report_["profile"] == profile
    rows = {row["name"]: row for row in report_["checks"]}
    assert set(rows) == {c.name for c in registry.for_profile(profile)}
    # Known on any machine: this Python passes, and the metadata endpoint (a closed port) fails,
    # so the report is not ok and the exit code says so.
    assert rows["python"]["status"] == "PASS", rows["python"]
    assert rows["imds"]["status"] == ("WARN" if profile == "login" else "FAIL"), rows["imds"]
    assert "nothing listens" in rows["imds"]["detail"]
    assert report_["ok"] is ("FAIL" not in {r["status"] for r in rows.values()})
    assert report_["ok"] is False or profile == "login"
    assert code == (0 if report_["ok"] else 1)
    for row in report_["checks"]:
        assert row["status"] in ("PASS", "WARN", "FAIL", "SKIP")
        assert row["detail"]
        if row["status"] != "PASS":
            assert row["fix"], row


def test_only_and_skip(capsys: pytest.CaptureFixture[str]) -> None:
    code, report_ = run_json(capsys, "--only", "python,disk", "--only", "imds", "--skip", "imds")
    assert [c["name"] for c in report_["checks"]] == ["python", "disk"]
    assert code == 0
    # --only may name a check from another profile: the user asked for it.
    _, report_ = run_json(capsys, "--profile", "login", "--only", "libstdcxx")
    assert [c["name"] for c in report_["checks"]] == ["libstdcxx"]


def test_exit_1_when_something_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text("27 1 254:0 / / rw - ext4 /dev/vda rw\n")
    code, report_ = run_json(capsys, "--only", "shared-fs", "--proc-root", str(tmp_path))
    assert code == 1 and report_["checks"][0]["status"] == "FAIL" and not report_["ok"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "nope"],
        ["--skip", "gpus,nope"],
        ["--profile", "head"],
        ["--timeout", "0"],
        ["--frobnicate"],
        ["--json", "--plain"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["check", *argv]) == 2
    assert "error" in capsys.readouterr().err


def test_help_and_list_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["check", "--help"]) == 0
    assert "--profile" in capsys.readouterr().out
    assert check.main(["check", "--list"]) == 0
    assert "var-log-mount" in capsys.readouterr().out


def test_hpkit_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    from hpkit import cli as hpkit_cli

    assert hpkit_cli.main(["check", "--only", "python", "--plain"]) == 0
    assert "PASS  python" in capsys.readouterr().out


def _check(name: str, fn) -> Check:
    return Check(name, name, ("login",), fn)


def test_runner_turns_a_crash_into_a_failed_row() -> None:
    def boom(ctx: Context) -> Result:
        raise RuntimeError("kaput")

    (outcome,) = runner.run_checks([_check("boom", boom)], Context())
    assert outcome.result.status is Status.FAIL and "kaput" in outcome.result.detail and outcome.result.fix


def test_runner_bounds_a_hung_check(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(runner, "GRACE_S", 0.1)

    def hang(ctx: Context) -> Result:
        release.wait(10)
        return Result.ok("late")

    ctx = Context(probe_timeout=0.1, imds_timeout=0.1)
    fast = _check("fast", lambda ctx: Result.ok("quick"))
    try:
        outcomes = runner.run_checks([_check("hang", hang), fast], ctx)
    finally:
        release.set()
    assert [o.result.status for o in outcomes] == [Status.FAIL, Status.PASS]
    assert "no answer within" in outcomes[0].result.detail


def _outcomes() -> list[runner.Outcome]:
    return [
        runner.Outcome("a", "A", Result.ok("fine"), 0.1),
        runner.Outcome("b", "B", Result.fail("pip install -e '.[train]' broke", "do [bold]x[/bold]"), 0.2),
    ]


def test_plain_text_when_rich_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    assert report.rich_table(_outcomes(), "login", 0.5) is False
    out = io.StringIO()
    report.show(_outcomes(), "login", 0.5, "table", out)
    text = out.getvalue()
    assert "FAIL  b  pip install" in text and "fix: do [bold]x[/bold]" in text
    assert "1 passed, 0 warned, 1 failed, 0 skipped" in text


def test_rich_table_keeps_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    assert report.rich_table(_outcomes(), "login", 0.5) is True
    out = capsys.readouterr().out
    assert "'.[train]'" in out and "[bold]x[/bold]" in out  # text, not markup
