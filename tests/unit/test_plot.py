"""`hpkit plot`: the curves are where the data puts them, the files decode at the requested size."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np  # matplotlib brings it
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from hpkit import cli, plot
from hpkit.metrics.file import read_metrics
from hpkit.netbench import nccl_tests
from hpkit.netbench.results import BenchRow, to_csv

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl-tests"


def metrics_file(path: Path) -> Path:
    """Run 1: steps 1-13, checkpoint at 10. Run 2 (requeued) resumes at 10 and runs 11-20."""
    lines = [{"event": "start", "step": 0, "total_steps": 20}]
    lines += [
        {"step": n, "loss": 10.0 - 0.25 * n, "tokens_per_s": 100.0 * n, "step_time_s": 0.01 * n}
        for n in range(1, 14)
    ]
    lines += [{"event": "checkpoint", "step": 10}, {"event": "start", "step": 10, "restart": 1}]
    lines += [
        {"step": n, "loss": 5.0 - 0.1 * n, "tokens_per_s": 2000.0, "step_time_s": 0.2} for n in range(11, 21)
    ]
    lines += [{"event": "checkpoint", "step": 20}, {"event": "end", "step": 20}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def run_cli(*args: str, capsys) -> tuple[int, str]:
    code = cli.main(["plot", *args])
    return code, capsys.readouterr().err


def test_training_curves_hold_the_metrics_and_do_not_join_runs(tmp_path):
    run = plot.TrainingRun("m", read_metrics(metrics_file(tmp_path / "m.jsonl")))
    fig = plot.training_figure([run], (800, 600))
    loss_ax, tps_ax, time_ax = fig.axes
    loss_lines = [line for line in loss_ax.get_lines() if str(line.get_gid()).startswith("loss:")]
    assert len(loss_lines) == 2, "each run is its own line: no stroke back from step 13 to 11"
    first, second = loss_lines
    assert list(first.get_xdata()) == list(range(1, 14))
    assert list(first.get_ydata()) == pytest.approx([10.0 - 0.25 * n for n in range(1, 14)])
    assert list(second.get_xdata()) == list(range(11, 21))
    assert list(second.get_ydata()) == pytest.approx([5.0 - 0.1 * n for n in range(11, 21)])
    assert first.get_color() == second.get_color()
    tps = next(line for line in tps_ax.get_lines() if str(line.get_gid()).startswith("tokens_per_s:"))
    assert list(tps.get_ydata()) == pytest.approx([100.0 * n for n in range(1, 14)])
    ms = next(line for line in time_ax.get_lines() if str(line.get_gid()).startswith("step_time_s:"))
    assert list(ms.get_ydata()) == pytest.approx([10.0 * n for n in range(1, 14)]), "step time in ms"
    for ax in fig.axes:
        marks = {
            (line.get_gid(), line.get_xdata()[0])
            for line in ax.get_lines()
            if line.get_gid() in ("restart", "checkpoint")
        }
        assert marks == {("checkpoint", 10), ("checkpoint", 20), ("restart", 10)}


def test_png_has_the_requested_size_and_the_restart_line_where_its_step_is(tmp_path):
    run = plot.TrainingRun("m", read_metrics(metrics_file(tmp_path / "m.jsonl")))
    fig = plot.training_figure([run], (640, 480))
    out = tmp_path / "m.png"
    plot.save(fig, out, "png")
    image = imread(out)
    assert image.shape[:2] == (480, 640)
    # Walk along the loss panel's x axis at mid-height: the restart's red appears at step 10's pixel column
    # (drawn over the checkpoint's green there) and nowhere else in the panel.
    ax = fig.axes[0]
    y_mid = sum(ax.get_ylim()) / 2
    assert to_rgb(plot.RESTART_STYLE["color"]) == pytest.approx((0.84, 0.15, 0.16), abs=0.01)
    x_lo, x_hi = (
        int(v) for v in ax.transData.transform([(ax.get_xlim()[0], y_mid), (ax.get_xlim()[1], y_mid)])[:, 0]
    )
    row = 480 - int(ax.transData.transform((10, y_mid))[1])
    # The dashes leave gaps: look at a few rows around the middle.
    band = image[row - 6 : row + 7, x_lo + 2 : x_hi - 2, :3]
    # Antialiasing blends the 1.2 px line into white: "red" is a strong red channel over weak green and blue.
    reddish = (band[:, :, 0] > 0.6) & (band[:, :, 1] < 0.45) & (band[:, :, 2] < 0.45)
    near_red = reddish.any(axis=0)
    red_columns = [x_lo + 2 + i for i in np.flatnonzero(near_red)]
    assert red_columns, "no restart line in the loss panel"
    expected = ax.transData.transform((10, y_mid))[0]
    assert all(abs(c - expected) <= 2 for c in red_columns), (red_columns, expected)


def test_cli_writes_svg_of_the_requested_size(tmp_path, capsys):
    path = metrics_file(tmp_path / "m.jsonl")
    code, err = run_cli(str(path), "-o", str(tmp_path / "m.svg"), "--size", "800x500", capsys=capsys)
    assert code == 0, err
    root = ET.parse(tmp_path / "m.svg").getroot()
    assert root.tag.endswith("svg")
    # Written in pt; 96 CSS pixels are 72 pt.
    width, height = (float(root.get(k).removesuffix("pt")) * 96 / 72 for k in ("width", "height"))
    assert (width, height) == pytest.approx((800, 500))
    assert len(root.findall(".//{http://www.w3.org/2000/svg}g[@id='restart']")) == 3  # one per panel
    code, err = run_cli(str(path), "-o", str(tmp_path / "plain"), "--format", "svg", capsys=capsys)
    assert code == 0 and ET.parse(tmp_path / "plain").getroot().tag.endswith("svg")


def rows(op: str, busbw: dict[int, float], ranks: int = 4) -> list[BenchRow]:
    return [
        BenchRow("hpkit", op, ranks, size, size // 4, "float", False, 10.0, bw, bw, 0, "gloo")
        for size, bw in busbw.items()
    ]


def test_collectives_overlay_on_a_log2_size_axis(tmp_path, capsys):
    sizes = [2**k for k in range(10, 21, 2)]
    node1 = rows("all_reduce", {s: s / 2**20 for s in sizes}) + rows("all_gather", {s: 1.0 for s in sizes})
    node2 = rows("all_reduce", {s: 2 * s / 2**20 for s in sizes})
    (tmp_path / "node1").mkdir()
    (tmp_path / "node2").mkdir()
    (tmp_path / "node1" / "bench.csv").write_text(to_csv(node1))
    (tmp_path / "node2" / "bench.csv").write_text(to_csv(node2))
    fig = plot.collectives_figure(
        [plot.BenchInput("node1", node1), plot.BenchInput("node2", node2)], (1000, 500)
    )
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["all_reduce", "all_gather"]
    reduce_ax = visible[0]
    assert reduce_ax.get_xscale() == "log" and reduce_ax.xaxis.get_transform().base == 2
    by_label = {line.get_label(): line for line in reduce_ax.get_lines()}
    assert sorted(by_label) == ["node1", "node2"]
    assert list(by_label["node2"].get_xdata()) == sizes
    assert list(by_label["node2"].get_ydata()) == pytest.approx([2 * s / 2**20 for s in sizes])
    assert [t.get_text() for t in reduce_ax.get_legend().get_texts()] == ["node1", "node2"]
    # Through the CLI: equal file names are told apart by their paths; PNG at the requested size.
    out = tmp_path / "bw.png"
    inputs = [str(tmp_path / "node1" / "bench.csv"), str(tmp_path / "node2" / "bench.csv")]
    code, err = run_cli(*inputs, "-o", str(out), "--size", "900x400", capsys=capsys)
    assert code == 0, err
    assert imread(out).shape[:2] == (400, 900)


def test_nccl_tests_output_plots_its_out_of_place_busbw(tmp_path):
    text = (FIXTURES / "all_reduce_perf-2x8-h100.txt").read_text()
    parsed = nccl_tests.rows_of(nccl_tests.parse(text))
    fig = plot.collectives_figure([plot.BenchInput("h100", parsed)], (600, 400))
    (line,) = fig.axes[0].get_lines()
    out_of_place = [r for r in parsed if not r.in_place]
    assert list(line.get_xdata()) == [r.size_bytes for r in out_of_place]
    assert list(line.get_ydata()) == [r.busbw_gbps for r in out_of_place]
    assert line.get_ydata()[-1] == 351.89  # the fixture's last out-of-place busbw, not the in-place 350.26


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{m}", "{csv}"], "mix training metrics"),
        (["{m}", "--size", "12x"], "--size '12x': give WIDTHxHEIGHT in pixels"),
        (["{m}", "--size", "50x50"], "each 100..10000"),
        (["{m}", "-o", "{tmp}/x.pdf"], ".pdf is not a format hpkit plot writes"),
        (["{m}", "-o", "{tmp}/x.png", "--format", "svg"], "disagree"),
        (["{tmp}/absent.jsonl"], "absent.jsonl: no such file"),
        (["{tmp}/absent.csv"], "absent.csv: no such file"),
        (["{bad_csv}"], "a CSV without the columns"),
        (["{tmp}/m.jsonl", "-o", "{tmp}/no/such/dir/x.png"], "cannot write"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    m = metrics_file(tmp_path / "m.jsonl")
    csv = tmp_path / "b.csv"
    csv.write_text(to_csv(rows("all_reduce", {1024: 1.0})))
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("size,busbw\n1,2\n")
    fill = {"m": str(m), "csv": str(csv), "tmp": str(tmp_path), "bad_csv": str(bad_csv)}
    argv = [a.format(**fill) for a in args]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out.png")]
    code, err = run_cli(*argv, capsys=capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpkit plot: error: ") and message in lines[0], err
