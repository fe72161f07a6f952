"""The planner's search: every layout the runtime accepts for a world, its memory and speed, ranked.

A layout is rejected with the runtime's own message when the runtime would refuse it (the spec's
validators, run on the layout; the adapter's and the pipeline's rules, which import torch, restated
with their words), with the planner's reason when it would cross nodes with tensor parallel, and with
by how many GiB when it does not fit the GPU (hpkit.plan.memory). The rest are ranked by predicted
tokens/s per GPU (hpkit.plan.speed), the smaller peak first among equals.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from hpkit.errors import SpecError
from hpkit.layout_rules.parallel import tp_problem
from hpkit.layout_rules.pipeline import MULTI_STAGE_SCHEDULES, SCHEDULES, microbatch_problem, stages_problem
from hpkit.models.llama.shape import ModelShape
from hpkit.plan import memory
from hpkit.plan.host_memory import plan_host
from hpkit.plan.layout import Layout
from hpkit.plan.speed import Hardware, SpeedPlan, predict
from hpkit.runtime.config import ParallelismSpec, RunConfig

GIB = 2**30
# Every pipeline schedule, in the order the search tries them (among equally fast layouts of equal peak the
# earlier ranks first): the spec's default first, GPipe (every microbatch in flight at once) last.
TRIED_SCHEDULES = sorted(
    SCHEDULES, key=lambda s: (s != ParallelismSpec.model_fields["pp_schedule"].default, s == "gpipe")
)


@dataclass
class Candidate:
    layout: Layout
    problem: str | None = None  # why it cannot run (None: it can)
    peak_bytes: float | None = None
    over_gib: float | None = None  # how far past the GPU's memory (None: it fits, or was never sized)
    memory: Any = None  # hpkit.plan.memory.MemoryPlan
    speed: SpeedPlan | None = None
    host: Any = None  # hpkit.plan.host_memory.HostMemory: in-memory checkpoints' RAM

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout.describe(),
            "parallelism": self.layout.parallelism_fields(),
            "train": self.layout.train_fields(),
            "fits": self.fits,
        }
        if self.peak_gib is not None:
            out["peak_gib"] = round(self.peak_gib, 2)
        if self.problem is not None:
            out["problem"] = self.problem
        if self.over_gib is not None:
            out["over_gib"] = round(self.over_gib, 2)
        if self.speed is not None:
            out["speed"] = self.speed.to_json()
        if self.memory is not None:
            out["memory_gib"] = {
                k: round(v / GIB, 3) for k, v in self.memory.worst.breakdown.as_dict().items()
            }
        if self.host is not None:
            out["host_memory"] = self.host.to_json()
        return out


@dataclass
class SearchResult:
    world: int
    global_batch: int
    ranked: list[Candidate] = field(default_factory=list)
    rejected: list[Candidate] = field(default_factory=list)
    dominated: int = 0  # not tried: the same with less checkpointing fits, or with full does not

    def closest_miss(self) -> Candidate | None:
        """The layout that missed the GPU's memory by the least (None: none was sized)."""
        sized = [c for c in self.rejected if c.over_gib is not None]
        return min(sized, key=lambda c: c.over_gib or 0.0) if sized else None


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt n): a world of any size (--nodes 99999999999 took minutes at O(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def runtime_problem(shape: ModelShape, layout: Layout, gpus_per_node: int | None) -> str | None:
    """Why the runtime would refuse `layout` for `shape`, in its own words; None when it runs it."""
    if gpus_per_node and layout.tp > gpus_per_node:
        return (
            f"parallelism.tp={layout.tp} spans more than one node of {gpus_per_node} GPUs: its per-block "
            "all-reduces would cross the network"
        )
    model: dict[str, Any] = {"name": "debug", "n_layers": shape.n_layers, "seq_len": shape.seq_len}
    if shape.is_moe:
        model["moe"] = {"experts": shape.experts, "top_k": min(shape.top_k or 1, shape.experts or 1)}
    try:
        RunConfig(model=model, parallelism=layout.parallelism_fields(), train=layout.train_fields())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not isinstance(p, int))
        message = first["msg"].removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    # The rules the trainer checks with the shape in hand (the adapter's check_tp, the pipeline's
    # check_microbatches and stage count): the same functions, hpkit.layout_rules's.
    if layout.tp > 1 and (
        problem := tp_problem(
            layout.tp, **shape.tp_dims(), sequence_parallel=layout.sequence_parallel_on("cuda")
        )
    ):
        return problem
    if layout.pp > 1 and (problem := microbatch_problem(layout.local_batch_size, layout.microbatches)):
        return problem
    return stages_problem(layout.pp, layout.stages_per_rank, shape.n_layers)


def judge(
    shape: ModelShape,
    layout: Layout,
    hw: Hardware,
    instance_type: str | None,
    gpu_memory_gib: float | None,
    always_speed: bool = False,
    memory_checkpoint: Any = None,
) -> Candidate:
    """One layout: the runtime's verdict, then its memory against the GPU's and its in-memory checkpoints'
    against the node's RAM (judged only with `memory_checkpoint`, the spec's checkpoint.memory), then its speed
    (for one that does not fit too, with `always_speed`)."""
    cand = Candidate(layout)
    cand.problem = runtime_problem(shape, layout, hw.gpus_per_node)
    if cand.problem is not None:
        return cand
    plan = memory.predict(shape, layout, instance_type)
    cand.memory = plan
    cand.host = plan_host(plan, instance_type, hw.gpus_per_node, memory_checkpoint)
    cand.peak_bytes = float(plan.peak_bytes)
    if gpu_memory_gib is not None and cand.peak_bytes > gpu_memory_gib * GIB:
        cand.over_gib = cand.peak_bytes / GIB - gpu_memory_gib
        cand.problem = (
            f"needs {cand.peak_bytes / GIB:.2f} GiB per GPU, {cand.over_gib:.2f} GiB more than the "
            f"{gpu_memory_gib:g} GiB a GPU has"
        )
        if not always_speed:
            return cand
    if cand.problem is None and cand.host.problem is not None:
        cand.problem = cand.host.problem
        if not always_speed:
            return cand
    cand.speed = predict(shape, layout, hw, shape.seq_len)
    return cand


def layouts(
    shape: ModelShape, world: int, gpus_per_node: int, global_batch: int, precision: str
) -> list[Layout]:
    """Every layout to try for `world` ranks, without activation checkpointing (search adds it): degrees that
    multiply to it (tp within a node), each pipeline schedule with microbatches of pp, 2pp and 4pp."""
    out = []
    tps = [t for t in _divisors(gpus_per_node) if t <= world and world % t == 0]
    for tp in tps:
        for pp in (p for p in _divisors(world // tp) if p <= shape.n_layers):
            rest = world // (tp * pp)
            eps = [e for e in _divisors(rest) if shape.is_moe and (shape.experts or 0) % e == 0] or [1]
            for ep in eps:
                dp = rest // ep
                if global_batch % (dp * ep):
                    continue
                lbs = global_batch // (dp * ep)
                for dp_rep in _divisors(dp):
                    pipelines: list[tuple[str, int, int]] = [("1f1b", 1, 1)]
                    if pp > 1:
                        pipelines = []
                        # Microbatches that divide the local batch; pp alone where none does, so that the
                        # runtime's refusal is shown once rather than never.
                        mults = [m for m in (1, 2, 4) if lbs % (pp * m) == 0] or [1]
                        for schedule, mult in itertools.product(TRIED_SCHEDULES, mults):
                            spr = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
                            pipelines.append((schedule, pp * mult, spr))
                    for schedule, mb, spr in pipelines:
                        out.append(
                            Layout(
                                dp_replicate=dp_rep,
                                dp_shard=dp // dp_rep,
                                tp=tp,
                                pp=pp,
                                ep=ep,
                                pp_schedule=schedule,  # type: ignore[arg-type]
                                microbatches=mb,
                                stages_per_rank=spr,
                                local_batch_size=lbs,
                                precision=precision,  # type: ignore[arg-type]
                            )
                        )
    return out


def search(
    shape: ModelShape,
    hw: Hardware,
    nodes: int,
    global_batch: int,
    precision: str,
    instance_type: str | None,
    gpu_memory_gib: float | None,
    memory_checkpoint: Any = None,
) -> SearchResult:
    world = nodes * hw.gpus_per_node
    if global_batch < 1 or global_batch % world:
        raise SpecError(
            f"--global-batch {global_batch}: the world of {world} GPUs ({nodes} nodes x {hw.gpus_per_node}) "
            f"does not divide it: give a multiple of {world}"
        )
    result = SearchResult(world=world, global_batch=global_batch)
    for bare in layouts(shape, world, hw.gpus_per_node, global_batch, precision):
        for cand in _checkpointing(shape, bare, hw, instance_type, gpu_memory_gib, result, memory_checkpoint):
            (result.ranked if cand.fits else result.rejected).append(cand)
    result.ranked.sort(key=lambda c: (-(c.speed.tokens_per_s_per_gpu if c.speed else 0), c.peak_bytes or 0))
    return result


def _checkpointing(
    shape: ModelShape,
    bare: Layout,
    hw: Hardware,
    instance_type: str | None,
    gpu_memory_gib: float | None,
    result: SearchResult,
    memory_checkpoint: Any = None,
) -> list[Candidate]:
    """The activation checkpointing modes worth judging for one layout. Checkpointing only saves memory and
    costs time, so: if full does not fit, neither do the others (one verdict stands for three); if none fits,
    the others are slower and are not tried."""

    def judged(mode: str) -> Candidate:
        layout = replace(bare, activation_checkpoint=mode)
        return judge(shape, layout, hw, instance_type, gpu_memory_gib, memory_checkpoint=memory_checkpoint)

    full = judged("full")
    if not full.fits and full.over_gib is not None:
        result.dominated += 2
        return [full]
    out = [full]
    for mode in ("none", "selective"):
        cand = judged(mode)
        out.append(cand)
        if cand.fits:
            result.dominated += 1 if mode == "none" else 0
            break
    return out


def why_lost(winner: Candidate, other: Candidate) -> str:
    """One line on why `other` ranks below `winner`: its largest extra cost, by part of the step."""
    if winner.speed is None or other.speed is None:
        return other.problem or "not sized"
    ratio = other.speed.tokens_per_s_per_gpu / winner.speed.tokens_per_s_per_gpu
    extra = {
        k: other.speed.parts.get(k, 0.0) - winner.speed.parts.get(k, 0.0)
        for k in set(other.speed.parts) | set(winner.speed.parts)
    }
    part, seconds = max(extra.items(), key=lambda kv: kv[1])
    return f"{ratio:.0%} of the winner's tokens/s: +{seconds * 1000:.0f} ms of {part} per step"
