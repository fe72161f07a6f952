"""The hang watchdog names culprits that heartbeats and totals alone would miss, in a real `hpkit train` on two
"nodes" of two ranks (two torchrun agents, FSDP x TP over gloo; bench/_hang_trials.py, the same drill the
bench repeats 20 times per fault):

- a rank that leaves out the step's loss all-reduce and goes on to the next step's all-gather: its count of
  collectives entered equals everyone's, so only the per-group comparison (whose wait began first) names it;
- a whole node frozen (its torchrun agent and both ranks SIGSTOPped), the node that holds rank 0 and the
  rendezvous store: a live rank on the other node writes the verdict, naming the node.

Both drills run side by side (their waits overlap); each must name its culprit within min_s + 10 s of the
fault's own timestamp.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _hang_trials import Trial, run_trial

pytestmark = pytest.mark.dist

MIN_S = 5.0


@pytest.fixture(scope="module")
def drills(tmp_path_factory) -> dict[str, Trial]:
    root = tmp_path_factory.mktemp("drills")
    wanted = {"skip": Trial("skip", 1), "frozen-node": Trial("frozen-node", 0)}
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {k: pool.submit(run_trial, t, root / k, MIN_S, 300) for k, t in wanted.items()}
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
    assert trial.detection_s <= MIN_S + 10, f"named after {trial.detection_s:.1f} s"
    # Every rank left its stacks and its flight-recorder trace, which holds the collectives compared.
    for rank in range(4):
        assert "most recent call first" in (folder / f"rank{rank}.txt").read_text()
        trace = json.loads((folder / f"fr-rank{rank}.json").read_text())
        assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"]), rank
    assert (folder / "culprit_nodes").read_text() == "nodeA\n"


def test_a_frozen_node_holding_rank_0_is_named_by_a_rank_on_the_other_node(drills):
    trial = drills["frozen-node"]
    folder = _folder(trial)
    verdict = trial.verdict
    assert verdict["culprits"] == [0, 1] and verdict["reason"] == "stopped", verdict
    assert "node nodeA froze" in verdict["line"] and verdict["line"] in trial.log
    assert trial.detection_s <= MIN_S + 10, f"named after {trial.detection_s:.1f} s"
    assert (folder / "culprit_nodes").read_text() == "nodeA\n"
    # The frozen ranks could not dump; the live ones did, and one of them wrote the verdict.
    assert verdict["no_stacks"] == [0, 1]
    for rank in (2, 3):
        assert "most recent call first" in (folder / f"rank{rank}.txt").read_text()
    attempt = folder.name.rsplit("-step", 1)[0]
    assert [p.name for p in (folder.parent / ".writers" / attempt).iterdir()] in (["rank2"], ["rank3"])
