"""`hpkit plan --goodput`: the Young/Daly optimum against the search, the model's direction, one case by hand,
and bad input as one line naming the flag."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hpkit.cli import main as cli
from hpkit.errors import SpecError
from hpkit.plan import goodput
from hpkit.plan.goodput import GoodputInputs

DEFAULT = GoodputInputs()
REPO = Path(__file__).resolve().parents[2]


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("nodes", [128, 512, 2048])
def test_young_daly_optimum_matches_the_numeric_search(nodes: int) -> None:
    step = DEFAULT.step_s
    p = goodput.persistent(DEFAULT, nodes)
    # The search is over whole steps: within one step of sqrt(2 C MTBF), and no worse than it rounded.
    assert abs(p.interval_s - p.young_daly_s) <= step
    rounded = round(p.young_daly_s / step) * step
    assert p.goodput >= goodput.persistent_goodput(DEFAULT, nodes, rounded) - 1e-12
    m = goodput.in_memory(DEFAULT, nodes)
    assert m.every_s is not None and m.every_young_daly_s is not None
    assert abs(m.every_s - m.every_young_daly_s) <= step
    # The persistent interval with in-memory recovery serves only the fallback: Young/Daly with its MTBF.
    assert abs(m.interval_s - m.young_daly_s) / m.young_daly_s < 0.02


def test_the_search_finds_the_best_whole_interval_that_trying_all_finds() -> None:
    inputs = replace(DEFAULT, step_s=60.0)  # a week of 60 s steps: 10,080 intervals, all of them tried
    for nodes in (128, 2048):
        best = goodput.persistent(inputs, nodes)
        every = [goodput.persistent_goodput(inputs, nodes, k * 60.0) for k in range(1, 10081)]
        assert best.interval_steps == every.index(max(every)) + 1
        mem = goodput.in_memory(inputs, nodes)
        assert mem.every_steps is not None
        copies = [goodput.memory_goodput(inputs, nodes, e * 60.0, mem.interval_s) for e in range(1, 10081)]
        assert mem.every_steps == copies.index(max(copies)) + 1


def test_goodput_falls_as_nodes_grow() -> None:
    rows = goodput.table(DEFAULT)
    for mode in ("persistent", "in-memory"):
        mine = [r for r in rows if r.mode == mode]
        assert [r.gpus for r in mine] == [1024, 4096, 16384]
        assert all(a.goodput > b.goodput for a, b in itertools.pairwise(mine))
        assert all(a.mtbf_h > b.mtbf_h for a, b in itertools.pairwise(mine))


@pytest.mark.parametrize(
    "inputs",
    [
        DEFAULT,
        replace(DEFAULT, copy_cost=0.2, step_s=20.0),
        replace(DEFAULT, fault_rate=1e-3, unrecoverable=0.2),
    ],
)
def test_in_memory_recovery_beats_persistent_only(inputs: GoodputInputs) -> None:
    rows = goodput.table(inputs)
    for persistent, memory in zip(rows[::2], rows[1::2], strict=True):
        assert persistent.mode == "persistent" and memory.mode == "in-memory"
        assert memory.goodput > persistent.goodput


def test_one_case_by_hand() -> None:
    # 2,048 nodes, Llama 3's rate: a fault every 54 x 24 x 3600 / 419 s on the job. A checkpoint every 100
    # steps of 5 s; 0.84 TB through 98.4 GB/s at 0.91 to write, at 98.4 GB/s to read back.
    mtbf = 54 * 24 * 3600 / 419  # 11,135.1 s
    write = 0.84e12 / (98.4e9 * 0.91)  # 9.381 s
    read = 0.84e12 / 98.4e9  # 8.537 s
    by_hand = 1 - write / 500 - (7 + 53 + read + 250) / mtbf  # 0.95263
    row = goodput.persistent(replace(DEFAULT, ckpt_interval=100), 2048)
    assert row.goodput == pytest.approx(by_hand, abs=1e-9)
    assert row.goodput == pytest.approx(0.95263, abs=1e-5)
    assert row.mtbf_h == pytest.approx(3.0931, abs=1e-4)

    # In memory, a copy every 10 steps (0.25 s each, 50 s apart), the node's 410 MB from its partner at
    # 400 GB/s, 10 % of faults unrecoverable; the partner's loss within 2 x 60.001 + 50 s falls back too.
    inputs = replace(DEFAULT, ckpt_interval=100, memory_every=10, unrecoverable=0.1)
    peer = 0.84e12 / 2048 / 400e9
    partner = 1 - math.exp(-419 / (54 * 24 * 2048) / 3600 * (2 * (7 + 53 + peer) + 50))
    p = 0.1 + 0.9 * partner
    loss = 7 + 53 + (1 - p) * (peer + 25) + p * (read + 250)
    by_hand = 1 - 0.25 / 50 - write / 500 - loss / mtbf
    row = goodput.in_memory(inputs, 2048)
    assert row.fallback_probability == pytest.approx(p, rel=1e-9)
    assert row.goodput == pytest.approx(by_hand, abs=1e-9)
    assert (row.every_steps, row.interval_steps) == (10, 100)


def test_on_few_nodes_each_nodes_own_link_to_the_file_system_binds() -> None:
    # 0.84 TB over 4 nodes: 4 x 12.5 GB/s = 50 GB/s, below the file system's 98.4 GB/s, sets both the write and
    # the read; from 8 nodes on (100 GB/s) the file system's aggregate does.
    assert DEFAULT.checkpoint_s(4) == pytest.approx(0.84e12 / (50e9 * 0.91))
    assert DEFAULT.fs_restore_s(4) == pytest.approx(0.84e12 / 50e9)
    assert DEFAULT.checkpoint_s(8) == pytest.approx(0.84e12 / (98.4e9 * 0.91))


def test_the_command_prints_both_modes_at_three_scales_and_the_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = plan(capsys, "--goodput")
    assert rc == 0 and err == ""
    rows = [
        line.split() for line in out.splitlines() if line.split()[:1] in (["1,024"], ["4,096"], ["16,384"])
    ]
    assert [(r[0], r[4]) for r in rows] == [
        (gpus, mode) for gpus in ("1,024", "4,096", "16,384") for mode in ("persistent", "in-memory")
    ]
    assert "target (issue 44): 16,384 GPUs, a fault every 3 h: in-memory" in out
    assert "Llama 3's 419 in 54 days" in out

    rc, out, _ = plan(capsys, "70B", "--goodput", "--instance", "p4d.24xlarge", "--nodes", "64", "--json")
    doc = json.loads(out)
    assert rc == 0 and [r["nodes"] for r in doc["rows"]] == [64, 64]
    # The model's own parameters x 12 bytes, and the instance's EFA rate.
    assert 0.84e12 < doc["inputs"]["state_bytes"] < 0.86e12 and doc["inputs"]["link_gbps"] == 400
    assert doc["target"]["in_memory"]["gpus"] == 16384

    rc, out, _ = plan(capsys, "--goodput", "--restart-s", "600", "--json")
    slower = json.loads(out)["rows"]
    rc, out, _ = plan(capsys, "--goodput", "--json")
    assert all(a["goodput"] < b["goodput"] for a, b in zip(slower, json.loads(out)["rows"], strict=True))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--fault-rate=-1"], "--fault-rate -1: must be greater than 0"),
        (["--fault-rate", "0"], "--fault-rate 0: must be greater than 0"),
        (["--state-bytes", "0"], "--state-bytes 0: must be greater than 0"),
        (["--copy-cost", "1.5"], "--copy-cost 1.5: a fraction"),
        (["--unrecoverable=-0.1"], "--unrecoverable -0.1: a fraction of the faults"),
        (["--memory-every", "2.5"], "--memory-every 2.5: a whole number"),
        (["--instance", "p9.48xlarge"], "--instance p9.48xlarge: unknown"),
        # Finite, but times the nodes a fault every 0 s: it divided by zero (a traceback).
        (["--fault-rate", "1e308", "--nodes", "2"], "--fault-rate 1e+308: on 2 node(s), a fault every 0 s"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    rc, out, err = plan(capsys, "--goodput", *args)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_zero_nodes_names_the_flag() -> None:
    with pytest.raises(SpecError, match=r"^--nodes 0: must be at least 1$"):
        goodput.table(DEFAULT, [0])
    with pytest.raises(SpecError, match=r"^--nodes 0: must be at least 1$"):
        goodput.nodes_for(0, DEFAULT)


def test_plan_without_a_target_or_goodput_says_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = plan(capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1 and "target: missing" in err


def test_goodput_imports_no_torch() -> None:
    # A login node runs it: the model, the flags and MODEL's parameter count stay torch-free.
    code = (
        "import sys\nfrom hpkit.cli import main\n"
        "assert main(['plan', '70B', '--goodput', '--instance', 'p5.48xlarge', '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "python")},
        check=False,
    )
    assert done.returncode == 0, done.stderr
