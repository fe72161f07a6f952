"""The metrics JSONL's field names are a file format: files already written, `hpkit status|plot` and users'
own scripts read them. These lines are what hpkit wrote before the records had one schema; a renamed
field changes what is written (first test) or loses a value on reading (second)."""

from __future__ import annotations

import pytest

from hpkit.metrics.file import MetricsReader
from hpkit.metrics.records import (
    CheckpointEvent,
    EndEvent,
    OtherEvent,
    StartEvent,
    StepRecord,
    StepTimesEvent,
    StragglerEvent,
)

T = 1700000000.125
GOLDEN = [
    '{"time": 1700000000.125, "event": "start", "step": 0, "total_steps": 9, "restart": 1, '
    '"resumed_from": "/ck/step-00000006", "world_size": 4}',
    '{"step": 7, "loss": 2.5, "grad_norm": 0.75, "lr": 0.001, "step_time_s": 0.5, "tokens_per_s": 2048.0, '
    '"tflops_per_device": 0.25, "mfu": null, "memory_max_rss_gib": 1.5, "time": 1700000000.125}',
    '{"time": 1700000000.125, "event": "checkpoint", "step": 7, "path": "/ck/step-00000007"}',
    '{"time": 1700000000.125, "event": "step_times", "step": 7, "steps": 5, "local_work_s": [0.25, 0.5], '
    '"step_s": [0.75, 0.75]}',
    '{"time": 1700000000.125, "event": "straggler", "step": 7, "rank": 1, "node": "node2", "factor": 2.0, '
    '"local_work_s": 0.5, "median_local_work_s": 0.25, "windows": 3}',
    '{"time": 1700000000.125, "event": "end", "step": 9, "total_steps": 9, "stopped_by_signal": 15}',
]
RECORDS = [
    StartEvent(0, total_steps=9, restart=1, resumed_from="/ck/step-00000006", world_size=4),
    StepRecord(7, 2.5, 0.75, 0.001, 0.5, 2048.0, 0.25, None, 1.5, "max_rss"),
    CheckpointEvent(7, path="/ck/step-00000007"),
    StepTimesEvent(7, 5, [0.25, 0.5], [0.75, 0.75]),
    StragglerEvent(
        7, rank=1, node="node2", factor=2.0, local_work_s=0.5, median_local_work_s=0.25, windows=3
    ),
    EndEvent(9, total_steps=9, stopped_by_signal=15),
]


def test_the_writer_writes_the_fields_it_always_wrote(tmp_path, monkeypatch):
    import io

    import hpkit.runtime.observe.metrics as metrics

    monkeypatch.setattr(metrics.time, "time", lambda: T)
    path = tmp_path / "m.jsonl"
    logger = metrics.MetricsLogger(enabled=True, jsonl_path=path, tensorboard_dir=None, stream=io.StringIO())
    for record in RECORDS:
        if isinstance(record, StepRecord):
            # 1024 tokens in 0.5 s on one rank; FLOPs per token chosen for 0.25 TFLOP/s; no known peak
            stats = metrics.StepStats(7, 2.5, 0.75, 0.001, 0.5, 1024, 1, 0.25e12 / 2048, None, 1.5, "max_rss")
            assert stats.record() == record
            logger.log(stats)
        else:
            logger.event(record)
    logger.close()
    assert path.read_text().splitlines() == GOLDEN


def test_the_readers_read_every_field_of_those_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(GOLDEN) + '\n{"time": 1.0, "event": "from_a_newer_hpkit", "step": 9}\n')
    log = MetricsReader(path).update()
    stamped = [
        r.__class__(**{**r.__dict__, "time": T}) if not isinstance(r, StepRecord) else r for r in RECORDS
    ]
    assert log.steps == [StepRecord(**{**RECORDS[1].__dict__, "time": T})]
    assert log.events[:-1] == [r for r in stamped if not isinstance(r, StepRecord)]
    assert log.events[-1] == OtherEvent(9, name="from_a_newer_hpkit", time=1.0)
    assert log.total_steps == 9 and log.restarts == 0 and log.run_starts == [0]
    assert log.of_kind(CheckpointEvent)[0].path == "/ck/step-00000007"


@pytest.mark.parametrize("bad", ['{"event": "start"}', '{"loss": 1.0}', "[1, 2]"])
def test_a_record_without_a_step_is_refused_in_one_line(tmp_path, bad):
    from hpkit.errors import HpkitError

    path = tmp_path / "m.jsonl"
    path.write_text(bad + "\n")
    with pytest.raises(HpkitError, match=r"m.jsonl:1: .*hpkit metrics file"):
        MetricsReader(path).update()


def test_a_start_records_phases_are_written_and_read_back(tmp_path):
    """The start-up's phases (bench_recovery splits a restart's seconds by them) travel through the file."""
    import io

    import hpkit.runtime.observe.metrics as metrics

    phases = {"process": 10.0, "imported": 12.5, "group": 13.0, "restored": 14.25}
    path = tmp_path / "m.jsonl"
    logger = metrics.MetricsLogger(enabled=True, jsonl_path=path, tensorboard_dir=None, stream=io.StringIO())
    logger.event(StartEvent(0, total_steps=9, phases=phases))
    logger.close()
    (start,) = MetricsReader(path).update().of_kind(StartEvent)
    assert start.phases == phases
