"""The straggler decision (a pure function of per-rank window times), its configuration, and what a CPU
rank's timer counts as its own work."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hpkit.errors import SpecError
from hpkit.runtime.config import RunConfig
from hpkit.runtime.watchdog.stragglers import StragglerDetector, WorkTimer, ring_link_figures, slowdowns
from hpkit.validation import parse_document


def test_slowdown_is_against_the_median_of_the_other_ranks():
    assert slowdowns([1.0, 1.0, 1.0, 4.0]) == [1.0, 1.0, 1.0, 4.0]
    # Two ranks: the median of all would cap any ratio below 2; the other rank's time does not.
    assert slowdowns([10.0, 1.0]) == [10.0, 0.1]
    assert slowdowns([2.0]) == [1.0]  # nothing to compare with
    assert slowdowns([0.0, 0.0, 3.0]) == [0.0, 0.0, 1.0]  # others idle: no ratio, no verdict


def test_a_rank_is_named_once_after_k_slow_windows_in_a_row():
    d = StragglerDetector(factor=1.5, windows=3)
    slow = [1.0, 1.0, 2.0, 1.0]
    assert d.update(slow) == []
    assert d.update(slow) == []
    (found,) = d.update(slow)
    assert (found.rank, found.factor, found.seconds, found.median_s) == (2, 2.0, 2.0, 1.0)
    assert d.update(slow) == []  # still slow: not named again
    assert d.update(slow) == []


def test_a_fast_window_breaks_the_streak_and_a_new_streak_is_named_again():
    d = StragglerDetector(factor=1.5, windows=2)
    slow, even = [1.0, 3.0, 1.0], [1.0, 1.0, 1.0]
    assert d.update(slow) == []
    assert d.update(even) == []
    assert d.update(slow) == []  # the streak started over
    assert [s.rank for s in d.update(slow)] == [1]
    assert d.update(even) == []
    assert d.update(slow) == []
    assert [s.rank for s in d.update(slow)] == [1]  # recovered, then slow again: a new warning


def test_the_factor_is_strict_and_several_ranks_can_straggle():
    d = StragglerDetector(factor=2.0, windows=1)
    assert d.update([1.0, 1.0, 1.0, 2.0]) == []  # exactly the factor: not slower than it
    found = d.update([1.0, 1.0, 1.0, 1.0, 5.0, 6.0])
    assert [(s.rank, s.median_s) for s in found] == [(4, 1.0), (5, 1.0)]


def test_even_noise_is_never_a_straggler():
    d = StragglerDetector(factor=1.5, windows=1)
    for shift in range(8):
        times = [1.0 + 0.1 * ((r + shift) % 4) for r in range(8)]  # +-30 % spread, every rank in turn
        assert d.update(times) == []


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"factor": 1.0}, "train.stragglers.factor: Input should be greater than 1"),
        ({"every_steps": 0}, "train.stragglers.every_steps: Input should be greater than or equal to 1"),
        ({"windows": 0}, "train.stragglers.windows: Input should be greater than or equal to 1"),
        ({"windws": 2}, "train.stragglers.windws: unknown key; did you mean 'windows'?"),
    ],
)
def test_bad_straggler_settings_are_one_line_naming_the_field(block, message):
    with pytest.raises(SpecError) as err:
        parse_document(RunConfig, {"train": {"stragglers": block}}, "job.yaml")
    assert str(err.value).startswith(f"job.yaml: {message}")
    assert "\n" not in str(err.value)


def test_stragglers_are_on_by_default_and_can_be_turned_off():
    spec = parse_document(RunConfig, {}).train.stragglers
    assert (spec.enabled, spec.every_steps, spec.factor, spec.windows) == (True, 20, 1.5, 3)
    assert not parse_document(
        RunConfig, {"train": {"stragglers": {"enabled": False}}}
    ).train.stragglers.enabled


def _spin(cpu_seconds: float) -> None:
    """Burn this much of the thread's own CPU time, however long a loaded machine makes that take."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="needs Linux schedstat")
def test_on_a_cpu_a_step_counts_its_compute_not_its_sleep_and_a_batch_wait_counts_whole():
    timer = WorkTimer(torch.device("cpu"))
    started = time.perf_counter()
    with timer.step():
        _spin(0.2)  # compute: this rank's own
        time.sleep(0.4)  # asleep, as in a collective waiting for the other ranks: not this rank's work
        with timer.device():
            _spin(0.1)  # counted once, by the step
    wall = time.perf_counter() - started
    mine = timer.take()
    # At least the 0.3 s of CPU; waiting for a core (a loaded machine) counts too, the sleep does not:
    # a timer of the whole step would read the wall time, one of the segment only 0.1.
    assert 0.3 <= mine < wall - 0.35, (mine, wall)
    started = time.perf_counter()
    with timer.step(), timer.host():
        time.sleep(0.3)  # waiting for a batch from loader workers is this rank's delay
        _spin(0.1)
    wall = time.perf_counter() - started
    assert 0.4 <= timer.take() <= wall + 0.01, wall
    assert timer.take() == 0.0  # a new window starts empty


def test_a_node_whose_links_are_all_slow_stands_out_and_its_neighbours_do_not():
    # Four nodes in a ring; node 2's links (1->2 and 2->3) take ten times as long as the others.
    receive_s = [0.01, 0.01, 0.1, 0.1]  # node i received from node i-1
    figures = ring_link_figures(receive_s)
    assert figures == [0.01, 0.01, 0.1, 0.01]
    (found,) = StragglerDetector(factor=3.0, windows=1).update(figures)
    assert found.rank == 2 and found.factor == pytest.approx(10.0)
    # One slow link alone (between nodes 1 and 2, one direction) names no node: each end has a fast one.
    assert StragglerDetector(factor=3.0, windows=1).update(ring_link_figures([0.01, 0.01, 0.1, 0.01])) == []


def test_the_link_probe_is_off_by_default_and_takes_a_byte_count():
    spec = parse_document(RunConfig, {}).train.stragglers
    assert spec.link_probe_bytes == 0
    with pytest.raises(SpecError, match="link_probe_bytes"):
        parse_document(RunConfig, {"train": {"stragglers": {"link_probe_bytes": -1}}}, source="run.yaml")
