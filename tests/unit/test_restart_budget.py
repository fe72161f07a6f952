"""hpkit.supervise.budget: one restart budget for a job, whoever restarts it, kept across requeues."""

from __future__ import annotations

from pathlib import Path

from hpkit.supervise.budget import Budget


def test_each_run_counts_once_and_the_first_run_is_no_restart() -> None:
    budget = Budget(max_restarts=2)
    assert not budget.count_run(0)  # the job's first run is no restart
    # hpkit counts its requeue before asking for it; the run it starts does not count again.
    assert budget.count_run(1) and not budget.count_run(1)
    assert (budget.used, budget.left, budget.can_restart()) == (1, 1, True)
    budget.spend()
    assert (budget.used, budget.left, budget.can_restart()) == (2, 0, False)


def test_a_budget_spent_past_its_limit_has_none_left_not_a_negative_count() -> None:
    # Slurm requeues by itself after a node failure, whatever the budget says: each such run counts when it starts.
    budget = Budget(max_restarts=1)
    for run in (1, 2, 3):
        budget.count_run(run)
    assert budget.used == 3 and budget.left == 0 and not budget.can_restart()


def test_the_budget_survives_a_requeue_in_its_file_and_a_torn_file_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "job.budget.json"
    budget = Budget(max_restarts=3)
    budget.count_run(1)
    budget.spend()
    budget.save(path)
    again = Budget.load(path, max_restarts=3)
    assert (again.used, again.counted_runs) == (2, [1])
    assert not again.count_run(1)
    path.write_text('{"used": 2, "counted_')
    assert Budget.load(path, max_restarts=3).used == 0
