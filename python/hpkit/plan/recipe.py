"""A search's winner as a job spec (`hpkit plan --write`, slurm/recipes/): the layout, the model, the
instance, and above them, in comments, the prediction and the runners-up with why each lost."""

from __future__ import annotations

from typing import Any

import yaml

from hpkit.plan.layout import Layout
from hpkit.plan.search import SearchResult, why_lost
from hpkit.plan.speed import Hardware

DEFAULT_STEPS = 1000


def model_block(target: str, seq: int) -> dict[str, Any]:
    """The spec's model: a shape name, or a Hugging Face folder (its shape and weights: init_from)."""
    from hpkit.models.llama.named import SHAPE_TABLE

    if target in SHAPE_TABLE:
        return {"name": target, "seq_len": seq}
    return {"init_from": target, "seq_len": seq}


def spec_text(
    name: str,
    model: dict[str, Any],
    hw: Hardware,
    nodes: int,
    result: SearchResult,
    top: int,
    command_line: str,
) -> str:
    win = result.ranked[0]
    layout, speed = win.layout, win.speed
    assert speed is not None and win.peak_gib is not None
    comments = [
        f"Written by `{command_line}`.",
        f"Predicted: {win.peak_gib:.1f} GiB per GPU, {speed.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"MFU {speed.mfu * 100:.1f}%, {speed.step_s:.3f} s per step of {result.global_batch} sequences.",
        f"{len(result.ranked)} layouts fit, {len(result.rejected)} rejected. Runners-up and why they lost:",
    ]
    for i, other in enumerate(result.ranked[1:top], start=2):
        comments.append(
            f"  #{i} {other.layout.describe()} ({other.peak_gib:.1f} GiB): {why_lost(win, other)}"
        )
    miss = result.closest_miss()
    if miss is not None:
        comments.append(f"  closest that does not fit: {miss.layout.describe()}: {miss.problem}")
    body = yaml.safe_dump(
        layout_spec(name, model, hw, nodes, layout), sort_keys=False, default_flow_style=None
    )
    return "".join(f"# {line}\n" for line in comments) + body


def layout_spec(
    name: str, model: dict[str, Any], hw: Hardware, nodes: int, layout: Layout, steps: int = DEFAULT_STEPS
) -> dict[str, Any]:
    """The job spec for one layout, as a mapping: what --write writes, and what each of --trial's jobs starts
    from (hpkit.plan.trial puts a base spec's job fields over it)."""
    return {
        "name": name,
        "nodes": nodes,
        "gpus_per_node": hw.gpus_per_node,
        "instance_type": hw.name,
        "launcher": "torchrun",
        "command": ["hpkit", "train"],
        "parallelism": layout.parallelism_fields(),
        "model": model,
        "train": {"steps": steps, **layout.train_fields()},
    }
