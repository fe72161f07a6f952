"""The progress line from a metrics file and a checkpoint directory, and finding a job's files from its script."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpkit.errors import HpkitError
from hpkit.jobs.files import files_for, spec_of_script
from hpkit.jobs.progress import progress
from hpkit.metrics.file import MetricsReader, read_metrics
from hpkit.render import render
from hpkit.runtime.checkpoints.checkpoint_record import CommitRecord, FileDigest, write_record
from hpkit.spec import JobSpec
from hpkit.validation import parse_document


def step(n: int, loss: float, step_time: float = 0.5, tps: float = 1000.0) -> dict:
    return {
        "step": n,
        "loss": loss,
        "step_time_s": step_time,
        "tokens_per_s": tps,
        "mfu": None,
        "time": 1e9 + n,
    }


def write(path: Path, records: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def commit(root: Path, n: int, created: float) -> None:
    directory = root / f"step-{n:08d}"
    directory.mkdir(parents=True)
    write_record(directory, CommitRecord(n, {"x.distcp": FileDigest(1, 0)}, 2, {}, created))


def test_reader_keeps_a_half_written_line_for_later(tmp_path):
    path = tmp_path / "m.jsonl"
    write(path, [{"event": "start", "step": 0, "total_steps": 100}, step(1, 5.0)])
    whole = json.dumps(step(2, 4.5))
    with path.open("a") as f:
        f.write(whole[:10])  # training is in the middle of writing this line
    reader = MetricsReader(path)
    log = reader.update()
    assert [s.step for s in log.steps] == [1] and log.total_steps == 100
    with path.open("a") as f:
        f.write(whole[10:] + "\n")
    assert [s.step for s in reader.update().steps] == [1, 2]
    assert [s.step for s in reader.update().steps] == [1, 2], "a line is read once"


def test_progress_of_a_restarted_run(tmp_path):
    path, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    write(path, [{"event": "start", "step": 0, "total_steps": 100}])
    write(path, [step(n, 10.0 - n / 10, step_time=9.0) for n in range(1, 13)])
    write(path, [{"event": "checkpoint", "step": 10}])
    # Requeued: resumes from 10, repeats 11 and 12 at another speed. Only this run's steps count for the ETA,
    # and not its first (start-up) step.
    write(path, [{"event": "start", "step": 10, "total_steps": 100, "restart": 1}])
    write(path, [step(11, 9.0, step_time=30.0, tps=10.0)])
    write(path, [step(n, 9.0 - n / 100, step_time=2.0, tps=4000.0) for n in range(12, 21)])
    commit(ckpt, 10, created=1234.0)
    commit(ckpt, 20, created=time.time())
    (ckpt / "step-00000030").mkdir()  # a save that never completed: no record
    p = progress(read_metrics(path), path, total_steps=None, checkpoint_dir=ckpt, slurm_restarts=0)
    assert (p.step, p.total_steps, p.restarts, p.finished) == (20, 100, 1, False)
    assert p.loss == pytest.approx(9.0 - 20 / 100)
    assert p.step_time_s == pytest.approx(2.0) and p.tokens_per_s == pytest.approx(4000.0)
    assert p.eta_s == pytest.approx(80 * 2.0)
    assert p.checkpoint is not None and p.checkpoint.step == 20
    line = p.line()
    assert line.startswith("step 20/100 (20%) | loss 8.8000 | 4,000 tok/s | ETA 0:02:40 | ckpt step 20 (")
    assert line.endswith("| restarts 1")
    # Slurm's count wins where the metrics file saw fewer runs (a requeue that died before training).
    assert progress(read_metrics(path), path, slurm_restarts=3).restarts == 3


def test_finished_run_and_checkpoints_from_the_metrics_file(tmp_path):
    path = tmp_path / "m.jsonl"
    write(path, [{"event": "start", "step": 0, "total_steps": 3}, step(1, 3.0), step(2, 2.0), step(3, 1.0)])
    write(path, [{"event": "checkpoint", "step": 3, "time": 5.0}, {"event": "end", "step": 3}])
    p = progress(read_metrics(path), path, checkpoint_dir=tmp_path / "gone")
    assert p.finished and "done" in p.line() and "ETA" not in p.line()
    assert p.checkpoint is not None and (p.checkpoint.step, p.checkpoint.saved) == (3, 5.0)
    stopped = tmp_path / "s.jsonl"
    write(stopped, [{"event": "start", "step": 0, "total_steps": 9}, step(1, 1.0)])
    write(stopped, [{"event": "end", "step": 1, "stopped_by_signal": 10}])
    assert not progress(read_metrics(stopped), stopped).finished


def test_no_steps_yet(tmp_path):
    p = progress(MetricsReader(tmp_path / "absent.jsonl").update(), tmp_path / "absent.jsonl", total_steps=50)
    assert p.step is None and p.line().startswith("no steps yet of 50")


def test_a_file_that_is_not_metrics_is_one_clear_error(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(HpkitError, match=r"other.jsonl:1: a record without an integer 'step'"):
        read_metrics(path)
    path.write_text("not json\n")
    with pytest.raises(HpkitError, match=r"other.jsonl:1: not a JSON record"):
        read_metrics(path)


def test_job_files_from_a_rendered_script_in_a_folder_with_spaces(tmp_path):
    workdir = tmp_path / "my runs" / "a b"
    workdir.mkdir(parents=True)
    spec_path = workdir / "logs" / "job it's.yaml"
    spec_path.parent.mkdir()
    data = {
        "name": "tiny",
        "command": ["hpkit", "train"],
        "train": {"steps": 7},
        "checkpoint": {"dir": "ckpt-%j"},
    }
    spec_path.write_text(json.dumps(data))
    script = workdir / "logs" / "tiny run.sbatch"
    script.write_text(
        render(parse_document(JobSpec, data), script_name=str(script), spec_path=str(spec_path))
    )
    assert spec_of_script(script) == spec_path
    files = files_for("4242", spec_path, workdir)
    assert files is not None
    assert files.metrics_path == workdir / "logs" / "tiny-4242.metrics.jsonl"
    assert files.checkpoint_dir == workdir / "ckpt-4242"
    assert files.total_steps == 7
    # Absolute paths in the spec stay as they are; a command that is not `hpkit train` is no training job.
    data |= {"train": {"steps": 7, "metrics_file": "/abs/m.jsonl"}, "checkpoint": {"dir": "/abs/ck"}}
    spec_path.write_text(json.dumps(data))
    files = files_for("1", spec_path, workdir)
    assert files is not None and files.metrics_path == Path("/abs/m.jsonl")
    assert files.checkpoint_dir == Path("/abs/ck")
    spec_path.write_text(json.dumps({**data, "command": ["bash", "-c", "sleep 1"]}))
    assert files_for("1", spec_path, workdir) is None
