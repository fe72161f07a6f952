"""The hang watchdog names culprits that heartbeats and totals alone would miss, in a real `hpkit train` on two
"nodes" of two ranks (two torchrun agents, FSDP x TP over gloo; bench/_hang_trials.py, the same drill the bench
repeats 20 times per fault), with nodeB's clocks running 30 s ahead of nodeA's (libfaketime on its agent and
ranks, wall and monotonic both), as on a cluster whose NTP has drifted:

- a rank that leaves out the step's loss all-reduce and goes on to the next step's all-gather: its count of
  collectives entered equals everyone's, so only the per-group comparison (whose wait began first, told by
  ages, not by the two nodes' clocks) names it;
- nodeA frozen (its torchrun agent and both ranks SIGSTOPped): it holds rank 0 and torchrun's store, through
  which the nodes report, so nodeB finds the store silent and names nodeA;
- nodeB frozen: it holds the judge; the standby on nodeA takes over and names nodeB;
- a rank stopped on the skewed node after 15 s of clean training (no hang called in those 15 s): named;
- a rank stopped inside a checkpoint save (every rank held there by HPKIT_FAULT slow_save): its peers wait for
  it still saying "save", which holds the clock for a save, not for a rank that stopped: named.

All five drills run side by side. How fast each is named is the bench's to measure (bench_hang_detection.py).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _torchrun import rank_pid, warm

from _hang_trials import SAVE_HOLD_S, Forked, Trial, remove_faketime_leftovers, run_trial, skewed

pytestmark = pytest.mark.dist

MIN_S = 5.0
SKEW = {"nodeB": skewed(30)}
CLEAN_S = 3 * MIN_S


@pytest.fixture(scope="module", autouse=True)
def _no_faketime_leftovers():
    """nodeB's killed and stopped ranks ran under libfaketime, which leaves a file pair each in /dev/shm."""
    yield
    remove_faketime_leftovers()


@pytest.fixture(scope="module")
def drills(tmp_path_factory) -> dict[str, Trial]:
    root = tmp_path_factory.mktemp("drills")
    wanted = {
        "skip": (Trial("skip", 1), 0.0),
        "store-node": (Trial("frozen-node", 0), 0.0),
        "judge-node": (Trial("frozen-node", 1), 0.0),
        "skewed-rank": (Trial("sigstop", 3), CLEAN_S),
        "in-save": (Trial("sigstop-in-save", 2), 0.0),
    }
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {
            k: pool.submit(
                run_trial,
                t,
                root / k,
                MIN_S,
                300,
                node_env=SKEW,
                clean_s=clean,
                forked=Forked(warm, rank_pid),
            )
            for k, (t, clean) in wanted.items()
        }
        return {k: f.result() for k, f in futures.items()}


def _folder(trial: Trial) -> Path:
    assert trial.verdict is not None, trial.log[-5000:]
    return Path(trial.verdict["stacks"])


def test_a_rank_that_skips_a_collective_is_named_though_its_totals_match(drills):
    trial = drills["skip"]
    folder = _folder(trial)
    assert "fault injected (HPKIT_FAULT): skip on rank 1" in trial.log
    assert trial.verdict["culprits"] == [1] and trial.verdict["reason"] == "skipped", trial.verdict
    assert "rank 1 on nodeA" in trial.verdict["line"] and "left out a collective" in trial.verdict["line"]
    assert trial.verdict["line"] in trial.log
    # Every rank left its stacks and its flight-recorder trace, which holds the collectives compared.
    for rank in range(4):
        assert "most recent call first" in (folder / f"rank{rank}.txt").read_text()
        trace = json.loads((folder / f"fr-rank{rank}.json").read_text())
        assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"]), rank
    assert (folder / "culprit_nodes").read_text() == "nodeA\n"


def test_a_frozen_node_holding_rank_0_and_the_store_is_named_by_the_other_node(drills):
    trial = drills["store-node"]
    folder = _folder(trial)
    verdict = trial.verdict
    assert verdict["reason"] == "store" and verdict["culprits"] == [0, 1], verdict
    assert "store on node nodeA" in verdict["line"] and "has not answered node nodeB" in verdict["line"]
    assert verdict["line"] in trial.log
    assert (folder / "culprit_nodes").read_text() == "nodeA\n"
    # The frozen ranks could not dump; the live ones did, and one of them wrote the verdict.
    for rank in (2, 3):
        assert "most recent call first" in (folder / f"rank{rank}.txt").read_text()
    attempt = folder.name.rsplit("-step", 1)[0]
    assert [p.name for p in (folder.parent / ".writers" / attempt).iterdir()] in (["rank2"], ["rank3"])


def test_a_frozen_judge_is_named_by_the_standby(drills):
    trial = drills["judge-node"]
    folder = _folder(trial)
    verdict = trial.verdict
    assert verdict["reason"] == "stopped" and verdict["culprits"] == [2, 3], verdict
    assert "node nodeB froze" in verdict["line"] and verdict["judge"] == "nodeA"
    assert verdict["no_stacks"] == [2, 3]
    assert (folder / "culprit_nodes").read_text() == "nodeB\n"


def test_a_node_whose_clock_runs_30_s_ahead_raises_no_hang_and_its_stopped_rank_is_named(drills):
    trial = drills["skewed-rank"]
    assert not trial.clean_verdict, "a hang was called during clean training"
    # nodeB's ranks (forked by a zygote that started with libfaketime's variables, as a cold rank starts with them)
    # report from other clocks than nodeA's: each report's `at` is its rank's monotonic clock, which libfaketime's
    # +30 s moves at least that far (it was 1.8e9 s against nodeA's 2.6e4, cold and forked alike).
    at = {int(r): b["at"] for r, b in trial.beats.items()}
    assert min(abs(at[b] - at[a]) for a in (0, 1) for b in (2, 3)) > 25, at
    verdict = trial.verdict
    assert verdict is not None, trial.log[-5000:]
    assert verdict["reason"] == "stopped" and verdict["culprits"] == [3], verdict
    assert "rank 3 on nodeB" in verdict["line"]
    # Nothing of the watchdog's was written under the output folder before the hang: only the hang's own files.
    hangs = Path(verdict["stacks"]).parent
    assert sorted(p.name for p in hangs.iterdir()) == sorted([".writers", Path(verdict["stacks"]).name])


def test_a_rank_stopped_inside_a_save_is_named_while_the_others_wait_in_it(drills):
    trial = drills["in-save"]
    verdict = trial.verdict
    assert verdict is not None, trial.log[-5000:]
    assert verdict["reason"] == "stopped" and verdict["culprits"] == [2], verdict
    assert "rank 2 on nodeB" in verdict["line"] and "heartbeat stopped" in verdict["line"], verdict
    # Named inside the save of step 6 (every rank held there SAVE_HOLD_S; the stopped rank's last frame is the
    # held save's), not by the collective timeout, and nothing of that save committed.
    assert "in before_save" in verdict["top_frames"]["2"], verdict
    assert trial.detection_s < SAVE_HOLD_S, trial.detection_s
    ckpt = Path(verdict["stacks"]).parents[1] / "ckpt"
    assert not (ckpt / "step-00000006").exists(), sorted(p.name for p in ckpt.iterdir())
