"""The hang watchdog's shared rule: when a job is stalled, and which rank holds it up."""

from __future__ import annotations

from hpkit.runtime.hang_watchdog import Beat, attempt_id, decide, top_frame

NOW = 1000.0


def beat(rank: int, **kw) -> Beat:
    fields = dict(
        rank=rank,
        node=f"node{rank // 2 + 1}",
        pid=100 + rank,
        step=5,
        step_end=NOW - 30,
        phase="step",
        collectives=40,
        beat_at=NOW - 0.5,
        median_step_s=0.5,
    )
    return Beat(**{**fields, **kw})


def test_a_job_that_finishes_steps_is_not_stalled():
    beats = [beat(r, step_end=NOW - 1) for r in range(4)]
    assert decide(beats, NOW, min_s=10, factor=10, world=4) is None


def test_the_limit_is_the_larger_of_min_s_and_factor_times_the_median_step():
    beats = [beat(r, step_end=NOW - 30, median_step_s=5.0) for r in range(4)]
    assert decide(beats, NOW, min_s=10, factor=10, world=4) is None  # 30 s < 10 x 5 s
    verdict = decide(beats, NOW, min_s=10, factor=5, world=4)
    assert verdict is not None and verdict.threshold_s == 25


def test_a_stopped_rank_is_named_first_even_inside_a_collective():
    beats = [beat(r) for r in range(4)]
    beats[2] = beat(2, beat_at=NOW - 20, collectives=41)  # frozen after entering one more collective
    verdict = decide(beats, NOW, min_s=10, factor=10, world=4)
    assert verdict is not None and verdict.culprits == [2] and verdict.reason == "stopped"
    assert "rank 2 on node2" in verdict.line() and "heartbeat stopped" in verdict.line()


def test_the_rank_behind_in_collectives_is_the_culprit():
    beats = [beat(r, collectives=41) for r in range(4)]
    beats[3] = beat(3, collectives=40)  # sleeping before the all-reduce the others are in
    verdict = decide(beats, NOW, min_s=10, factor=10, world=4)
    assert verdict is not None and verdict.culprits == [3] and verdict.reason == "behind"


def test_when_no_rank_stands_out_the_line_names_the_candidates():
    verdict = decide([beat(r) for r in range(2)], NOW, min_s=10, factor=10, world=2)
    assert verdict is not None and verdict.reason == "unknown" and verdict.culprits == [0, 1]
    assert "cannot be told" in verdict.line() and "rank 0 on node1, rank 1 on node1" in verdict.line()


def test_saves_the_start_and_missing_ranks_hold_the_clock():
    beats = [beat(r) for r in range(4)]
    beats[1] = beat(1, phase="save")
    assert decide(beats, NOW, min_s=10, factor=10, world=4) is None
    starting = [beat(r, phase="start", step_end=NOW - 30) for r in range(4)]
    assert decide(starting, NOW, min_s=10, factor=10, world=4, start_s=60) is None
    assert decide(starting, NOW, min_s=10, factor=10, world=4, start_s=20) is not None
    assert decide([beat(r) for r in range(3)], NOW, min_s=10, factor=10, world=4) is None


def test_attempts_differ_across_restarts_and_agree_across_ranks():
    a = attempt_id({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    assert a == attempt_id({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "RANK": "3"})
    assert a != attempt_id({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"})
    assert a != attempt_id({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "HPKIT_STEP_ATTEMPT": "1"})


def test_top_frame_is_the_main_threads_innermost_frame():
    assert top_frame("rank 1 on n1\nmain thread at: /x/y.py:3 in f\n\nThread 0x1:\n") == "/x/y.py:3 in f"
    # A stopped rank's own dump, written by faulthandler's signal handler on its main thread.
    dump = (
        "Thread 0x00007f (most recent call first):\n"
        '  File "/x/hpkit/runtime/hang_watchdog.py", line 200 in _on_hang\n'
        '  File "/usr/lib/python3.11/threading.py", line 975 in run\n'
        "\n"
        "Current thread 0x00007e (most recent call first):\n"
        '  File "/x/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
        '  File "/x/hpkit/runtime/trainer.py", line 400 in train_step\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
    )
    assert top_frame(dump) == "/x/torch/distributed/c10d_logger.py:83 in wrapper"
    # The handler may run on another thread: the main thread is still the one not started by threading.
    other = dump.replace("Current thread 0x00007e", "Thread 0x00007e").replace(
        "Thread 0x00007f", "Current thread 0x00007f"
    )
    assert top_frame(other) == "/x/torch/distributed/c10d_logger.py:83 in wrapper"
