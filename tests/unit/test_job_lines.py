"""What a job leaves for others to read, written and read through the same functions (hpkit.job_events): each
status line its writer prints, as `hpkit why` finds it in the job's output, and the hang folders the watchdog
writes, as the supervisor and `why` find them."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpkit import job_events
from hpkit.jobs.why import FAULT, HANG_LINE, RANK_FAILED_ON, TRAIN_DONE, TRAIN_STOPPED
from hpkit.jobs.why_scan import scan_output
from hpkit.runtime.watchdog.hang_rules import Verdict
from hpkit.supervise.hangs import culprit_nodes, verdict_path


def found(line: str, rank: int = 0):
    """The one finding `why` makes of `line`, printed by `rank` under srun --label."""
    findings = scan_output([f"{rank:>2}: {line}\n"], "job.out")
    assert len(findings) == 1, (line, findings)
    return findings[0]


def verdict(reason: str, culprits: list[int], **extra) -> Verdict:
    nodes = {0: "node1", 1: "node2", 2: "node2", 3: "node3"}
    fields = {"top_frames": {}, **extra}
    return Verdict(
        step=11, stalled_s=61.2, threshold_s=60.0, culprits=culprits, reason=reason, nodes=nodes, **fields
    )


@pytest.mark.parametrize(
    ("sample", "rank", "node"),
    [
        (verdict("behind", [1], group="3", top_frames={1: ".../train.py:88 in load_batch"}), 1, "node2"),
        (verdict("skipped", [3]), 3, "node3"),
        (verdict("mismatch", [2], group="1"), 2, "node2"),
        (verdict("stopped", [1, 2]), 1, "node2"),  # every rank of node2 froze
        (verdict("unknown", [0, 3]), None, None),  # the candidates are no culprit
        (verdict("store", [], store="10.0.0.1:29500", store_node="node1", reporter="node2"), None, None),
    ],
)
def test_every_hang_line_reads_back(sample: Verdict, rank: int | None, node: str | None) -> None:
    stacks = Path("logs/hangs") / "1234-0-0-0-step12"
    line = job_events.hang_line(sample.line(), stacks)
    finding = found(line)
    assert finding.kind == HANG_LINE
    assert (finding.detail, finding.where) == (sample.line(), str(stacks))
    assert (finding.rank, finding.node) == (rank, node)


def test_the_fault_line_reads_back() -> None:
    finding = found(job_events.fault_line("hang", 3, 17), rank=3)
    assert (finding.kind, finding.rank, finding.detail) == (FAULT, 3, "hang")
    assert job_events.parse_fault_line(job_events.fault_line("skip", 1, 5)) == ("skip", 1, 5)
    finding = found(job_events.fault_line("hang_eval", 2, 8, in_eval=True), rank=2)
    assert (finding.kind, finding.rank, finding.detail) == (FAULT, 2, "hang_eval")


def test_the_stopping_line_reads_back() -> None:
    finding = found(job_events.stopping_line(41, 10))
    assert (finding.kind, finding.signal, finding.detail) == (
        TRAIN_STOPPED,
        10,
        "stopping at step 41 on signal 10",
    )
    assert job_events.parse_stopping_line(job_events.stopping_line(41, 10))[1:] == (41, 10)


def test_the_done_line_reads_back() -> None:
    fields = {"steps": "20", "final_loss": "4.1000", "mfu": "n/a", "world": "4", "layout": "dp_shard:2,tp:2"}
    line = job_events.done_line(fields)
    assert found(line).kind == TRAIN_DONE
    assert job_events.parse_done_line(line) == fields


def test_the_agent_s_rank_line_reads_back() -> None:
    line = job_events.rank_failed_line(5, "ip-10-1-2-3", -9)
    finding = scan_output([line + "\n"], "job.out")  # the agent's own line: not a rank's, so unlabelled
    assert [(f.kind, f.rank, f.node) for f in finding] == [(RANK_FAILED_ON, 5, "ip-10-1-2-3")]
    assert job_events.parse_rank_failed_line(line) == job_events.RankFailed(5, "ip-10-1-2-3", -9)
    assert job_events.parse_rank_failed_line(" 0: " + line) == job_events.RankFailed(5, "ip-10-1-2-3", -9)


def test_the_stays_line_reads_back() -> None:
    line = job_events.stays_line(
        3, "ip-10-1-2-3", 4242, "its process group broke (Connection closed by peer)"
    )
    assert job_events.parse_stays_line(line) == job_events.RankStays(3, "ip-10-1-2-3", 4242)
    assert job_events.parse_stays_line("[rank3]: " + line) == job_events.RankStays(3, "ip-10-1-2-3", 4242)


def test_a_line_of_another_kind_is_none_of_them() -> None:
    line = "hpkit train: resumed from /ckpt/step-00000010 at step 10"
    assert scan_output([f"0: {line}\n"], "job.out") == []
    assert job_events.parse_hang_line(line) is None
    assert job_events.parse_fault_line(line) is None
    assert job_events.parse_stopping_line(line) is None
    assert job_events.parse_done_line(line) is None
    assert job_events.parse_rank_failed_line(line) is None
    assert job_events.parse_stays_line(line) is None


def test_the_watchdogs_hang_folder_is_where_the_supervisor_and_why_look(tmp_path: Path) -> None:
    hangs = job_events.hangs_dir(tmp_path / "logs")
    attempt = job_events.hang_attempt("1234", "2", "1", "0")
    folder = job_events.hang_folder(hangs, attempt, 12)
    folder.mkdir(parents=True)
    (folder / job_events.CULPRIT_NODES).write_text("node2\n", encoding="utf-8")
    (folder / job_events.VERDICT).write_text("{}", encoding="utf-8")
    other = job_events.hang_folder(hangs, job_events.hang_attempt("1234", "2", "0", "0"), 9)
    other.mkdir()
    (other / job_events.VERDICT).write_text("{}", encoding="utf-8")

    found_verdict = verdict_path(hangs, "1234", 2, 1)
    assert found_verdict == folder / job_events.VERDICT
    assert culprit_nodes(found_verdict) == ["node2"]
    assert verdict_path(hangs, "1234", 1, 1) is None
    assert verdict_path(hangs, "123", 2, 1) is None
    assert job_events.verdict_paths(hangs, "1234") == [
        other / job_events.VERDICT,
        folder / job_events.VERDICT,
    ]
    assert job_events.verdict_restart(found_verdict) == 2
    assert job_events.verdict_folder(str(found_verdict)) == str(folder)


def test_a_job_array_tasks_hang_folder_names_its_restart(tmp_path):
    from hpkit.job_events import VERDICT, verdict_paths, verdict_restart

    folder = tmp_path / "7200_3-2-0-0-step9"
    folder.mkdir()
    (folder / VERDICT).write_text("{}")
    (verdict,) = verdict_paths(tmp_path, "7200_3")
    assert verdict_restart(verdict) == 2
    assert verdict_paths(tmp_path, "7200_3", restart=2, attempt=0) == [verdict]
