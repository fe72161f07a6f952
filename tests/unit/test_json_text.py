"""Files that may be torn or hostile: JSON nested past the parser's recursion limit reads as malformed JSON (a
ValueError, which every reader catches), not as a RecursionError traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpkit import job_events, json_text
from hpkit.runtime.checkpoints.checkpoint_record import RECORD_FORMAT, RECORD_NAME, RecordError, read_record

DEEP = '{"type": "x", "v": ' + "[" * 20000 + "]" * 20000 + "}"


def test_deeply_nested_json_is_malformed_json() -> None:
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        json_text.loads(DEEP)
    assert json_text.loads('{"a": [[1]]}') == {"a": [[1]]}


def test_a_commit_record_nested_too_deeply_or_with_an_infinite_count_is_unreadable(tmp_path: Path) -> None:
    # `hpkit ckpt ls|verify` and every resume read it: both ended in a traceback.
    (tmp_path / RECORD_NAME).write_text(DEEP)
    with pytest.raises(RecordError, match=r"is unreadable: JSONDecodeError: nested too deeply"):
        read_record(tmp_path)
    (tmp_path / RECORD_NAME).write_text(
        f'{{"format": {RECORD_FORMAT}, "step": 5, "files": {{}}, "world_size": 1e400}}'
    )
    with pytest.raises(RecordError, match=r"is unreadable: OverflowError"):
        read_record(tmp_path)


def test_an_events_line_nested_too_deeply_is_skipped_as_a_torn_one() -> None:
    lines = ['{"type": "start"}', DEEP, '{"type": "end"}']
    assert [event["type"] for _, _, event in job_events.read(lines)] == ["start", "end"]
