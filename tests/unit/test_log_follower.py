"""`hpkit logs [-f]`'s copy of a job's output file (hpkit.jobs.watch.LogFollower): a chunk at a time, whole characters,
only what is new, and from the start again when a requeued job truncated the file."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from hpkit.jobs import watch
from hpkit.slurm import JobInfo, JobState


class _Writes(io.StringIO):
    """A stream that remembers the size of each write."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, text: str) -> int:
        self.sizes.append(len(text))
        return super().write(text)


def _info(path: Path) -> JobInfo:
    return JobInfo(job_id="7", name="run", state=JobState.RUNNING, stdout=str(path))


def test_a_large_log_is_copied_a_chunk_at_a_time_with_whole_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "CHUNK_BYTES", 7)  # odd, so that chunks cut the 2- and 3-byte characters
    log = tmp_path / "run.out"
    text = "step 1 loss 7.81 — ü\n" * 50
    log.write_text(text, encoding="utf-8")
    out = _Writes()
    follower = watch.LogFollower(out)
    follower.pump(_info(log))
    assert out.getvalue() == text
    assert max(out.sizes) <= 7  # never the whole file in one read
    # Only what was added since is copied next time.
    with log.open("a", encoding="utf-8") as handle:
        handle.write("step 2 ✓\n")
    follower.pump(_info(log))
    assert out.getvalue() == text + "step 2 ✓\n"


def test_a_truncated_log_is_read_again_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "run.out"
    log.write_text("first run, a long line of output\n")
    out = io.StringIO()
    follower = watch.LogFollower(out)
    follower.pump(_info(log))
    log.write_text("requeued\n")  # shorter than what was read: the file was truncated and written again
    follower.pump(_info(log))
    assert out.getvalue() == "first run, a long line of output\nrequeued\n"


def test_a_missing_log_prints_nothing_until_it_appears(tmp_path: Path) -> None:
    log = tmp_path / "run.out"
    out = io.StringIO()
    follower = watch.LogFollower(out)
    follower.pump(_info(log))
    assert out.getvalue() == ""
    log.write_text("started\n")
    follower.pump(_info(log))
    assert out.getvalue() == "started\n"


def test_the_default_stream_is_stdout_as_it_is_when_the_follower_is_made(tmp_path: Path) -> None:
    log = tmp_path / "run.out"
    log.write_text("started\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        watch.LogFollower().pump(_info(log))
    assert out.getvalue() == "started\n"
