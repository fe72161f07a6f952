"""Figures for `hpkit plot`: a training run's curves, and collective bandwidth against message size.

matplotlib's object API on the Agg canvas: no pyplot, no display, no global figure state, so it runs
on a login node without X and in tests side by side. Markers (restarts, checkpoints) carry a gid so
that they can be found again in the figure and in an SVG.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter

from hpkit.metrics.file import MetricsLog
from hpkit.metrics.records import CheckpointEvent, EvalEvent, StartEvent, StepRecord
from hpkit.netbench.results import BenchRow

# (field of the step records, axis label, factor)
TRAINING_PANELS: tuple[tuple[str, str, float], ...] = (
    ("loss", "loss", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("step_time_s", "step time (ms)", 1000.0),
)
RESTART_STYLE = {"color": "tab:red", "linestyle": "--", "linewidth": 1.2}
CHECKPOINT_STYLE = {"color": "tab:green", "linestyle": ":", "linewidth": 1.0}
# Validation losses (eval records) on the loss panel: the run's colour, dashed, a marker per validation.
EVAL_STYLE = {"linestyle": "--", "linewidth": 1.0, "marker": "o", "markersize": 3}
OP_ORDER = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")
PNG_DPI = 100
SVG_DPI = 96  # an SVG's size is written in pt (1/72 in); at 96 per inch it is the requested CSS pixels


@dataclass
class TrainingRun:
    label: str
    log: MetricsLog
    checkpoint_steps: set[int] = field(default_factory=set)  # from the checkpoint directory, if known

    def restart_steps(self) -> list[int]:
        """Where each run after the first began (the step it resumed from)."""
        return [e.step for e in self.log.of_kind(StartEvent)[1:]]

    def all_checkpoint_steps(self) -> list[int]:
        return sorted(self.checkpoint_steps | {e.step for e in self.log.of_kind(CheckpointEvent)})

    def eval_points(self) -> list[tuple[int, float]]:
        """(step, validation loss) of the validations during training (eval.only ones are no curve)."""
        return [(e.step, e.loss) for e in self.log.of_kind(EvalEvent) if not e.only]

    def segments(self) -> list[list[StepRecord]]:
        """The step records of each run: a resumed run repeats steps, and must not draw a line back."""
        bounds = (
            [*self.log.run_starts, len(self.log.steps)] if self.log.run_starts else [0, len(self.log.steps)]
        )
        if bounds[0] != 0:
            bounds.insert(0, 0)
        return [self.log.steps[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def new_figure(size_px: tuple[int, int], dpi: int) -> Figure:
    fig = Figure(figsize=(size_px[0] / dpi, size_px[1] / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def training_figure(runs: list[TrainingRun], size_px: tuple[int, int], dpi: int = PNG_DPI) -> Figure:
    """Loss, tokens/s and step time over steps, one panel each; restarts and checkpoints as vertical lines."""
    fig = new_figure(size_px, dpi)
    axes = fig.subplots(len(TRAINING_PANELS), 1, sharex=True)
    colors = [f"C{i}" for i in range(10)]
    for ax, (key, label, factor) in zip(axes, TRAINING_PANELS, strict=True):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        for i, run in enumerate(runs):
            for j, segment in enumerate(run.segments()):
                points = [(r.step, value * factor) for r in segment if (value := getattr(r, key)) is not None]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(
                    xs,
                    ys,
                    color=colors[i % len(colors)],
                    linewidth=1.4,
                    label=run.label if j == 0 else None,
                    gid=f"{key}:{i}:{j}",
                )
        if key == "loss":
            for i, run in enumerate(runs):
                if points := run.eval_points():
                    xs, ys = zip(*points, strict=True)
                    label = f"{run.label} (eval)" if len(runs) > 1 else "eval loss"
                    ax.plot(
                        xs, ys, color=colors[i % len(colors)], label=label, gid=f"eval_loss:{i}", **EVAL_STYLE
                    )
        for run in runs:
            for step in run.all_checkpoint_steps():
                ax.axvline(step, gid="checkpoint", **CHECKPOINT_STYLE)
            for step in run.restart_steps():
                ax.axvline(step, gid="restart", **RESTART_STYLE)
    axes[-1].set_xlabel("step")
    _marker_legend(axes[0], runs)
    return fig


def _marker_legend(ax, runs: list[TrainingRun]) -> None:
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if len(runs) < 2:  # one run's curve needs no legend; its validation loss does
        kept = [(h, lab) for h, lab in zip(handles, labels, strict=True) if lab == "eval loss"]
        handles, labels = [h for h, _ in kept], [lab for _, lab in kept]
    if any(run.all_checkpoint_steps() for run in runs):
        handles.append(Line2D([], [], **CHECKPOINT_STYLE))
        labels.append("checkpoint")
    if any(run.restart_steps() for run in runs):
        handles.append(Line2D([], [], **RESTART_STYLE))
        labels.append("restart")
    if handles:
        ax.legend(handles, labels, loc="upper right", fontsize="small")


@dataclass(frozen=True)
class BenchInput:
    label: str
    rows: list[BenchRow]


def bandwidth_series(rows: Iterable[BenchRow], op: str) -> dict[int, list[tuple[int, float]]]:
    """ranks -> (size, busbw) sorted by size, for one collective. Out-of-place rows where there are any
    (nccl-tests prints both placements; hpkit measures out-of-place)."""
    mine = [r for r in rows if r.op == op]
    if any(not r.in_place for r in mine):
        mine = [r for r in mine if not r.in_place]
    out: dict[int, dict[int, float]] = {}
    for r in mine:
        out.setdefault(r.ranks, {})[r.size_bytes] = r.busbw_gbps
    return {ranks: sorted(points.items()) for ranks, points in sorted(out.items())}


def collectives_figure(inputs: list[BenchInput], size_px: tuple[int, int], dpi: int = PNG_DPI) -> Figure:
    """busbw against message size (log-2 axis), one panel per collective, every input overlaid."""
    found = {r.op for i in inputs for r in i.rows}
    ops = [op for op in OP_ORDER if op in found] + sorted(found - set(OP_ORDER))
    cols = 1 if len(ops) == 1 else 2
    rows_n = math.ceil(len(ops) / cols)
    fig = new_figure(size_px, dpi)
    grid = fig.subplots(rows_n, cols, squeeze=False)
    for k, op in enumerate(ops):
        ax = grid[k // cols][k % cols]
        ax.set_title(op)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        sizes: set[int] = set()
        for n, item in enumerate(inputs):
            series = bandwidth_series(item.rows, op)
            for ranks, points in series.items():
                xs, ys = zip(*points, strict=True)
                sizes.update(xs)
                label = item.label if len(series) == 1 else f"{item.label} ({ranks} ranks)"
                ax.plot(
                    xs, ys, marker="o", markersize=3, color=f"C{n % 10}", label=label, gid=f"{op}:{n}:{ranks}"
                )
        _size_ticks(ax, sorted(sizes))
        ax.legend(fontsize="small")
    for k in range(len(ops), rows_n * cols):
        grid[k // cols][k % cols].set_visible(False)
    return fig


def _size_ticks(ax, sizes: list[int]) -> None:
    """At most ~8 labelled powers of two, written as 8 B, 1 KiB, 256 MiB."""
    if not sizes:
        return
    lo, hi = int(math.log2(min(sizes))), math.ceil(math.log2(max(sizes)))
    stride = max(1, math.ceil((hi - lo + 1) / 8))
    ax.xaxis.set_major_locator(FixedLocator([2.0**e for e in range(lo, hi + 1, stride)]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human_size(x)))


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} B"


def save(fig: Figure, path: Path, fmt: str) -> None:
    # No bbox_inches="tight": it would change the requested size.
    fig.savefig(path, format=fmt, dpi=fig.dpi)
