"""The notes `hpkit submit` leaves for jobs the controller will forget."""

from __future__ import annotations

import pytest

from hpkit.jobs.index import JobNote, index_dir, recall, remember


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("HPKIT_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / "jobs"


def test_a_note_is_recalled_by_id_and_only_for_the_same_job_name(state):
    note = JobNote("42", "train", "/runs/logs/train-1.sbatch", "/runs")
    assert remember(note) is None
    assert recall("42") == note
    assert recall("42", name="train") == note
    assert recall("42", name="other") is None  # the id was reused by another job
    assert recall("43") is None
    assert [p.name for p in state.iterdir()] == ["42.json"]  # no temporary file left


@pytest.mark.parametrize(
    "text", ["", "{", "[]", '{"job_id": "42"}', '{"job_id": "7", "name": "a", "script": "s", "workdir": "w"}']
)
def test_a_damaged_or_foreign_note_is_ignored(state, text):
    state.mkdir(parents=True)
    (state / "42.json").write_text(text)
    assert recall("42") is None


def test_ids_that_are_not_numbers_never_reach_the_file_system(state):
    assert recall("../../etc/passwd") is None and recall("") is None


def test_a_file_in_the_way_is_a_reason_not_an_error(tmp_path, monkeypatch):
    (tmp_path / "state").write_text("not a directory")
    monkeypatch.setenv("HPKIT_STATE_DIR", str(tmp_path / "state"))
    why = remember(JobNote("1", "a", "s", "w"))
    assert why is not None and why.startswith(f"cannot write {index_dir() / '1.json'}")


def test_the_default_place_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("HPKIT_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert index_dir() == tmp_path / "hpkit" / "jobs"
