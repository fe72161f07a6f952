"""Pipeline parallel as plain numbers: the schedule names, which stages a pp rank holds, which blocks a stage
holds, and the settings torch's schedules (2.13) refuse.

The runtime (hpkit.runtime.parallel.pipeline, which imports the class named here for each schedule) and the planner
(hpkit.plan) both call these functions: one placement, one set of rules.
"""

from __future__ import annotations

from typing import Literal, get_args

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
# Each schedule's class in torch.distributed.pipelining (by name: this module is torch-free); a new schedule is a
# name above and its class here (tests/unit/test_runtime_parallel_dims.py imports each).
TORCH_CLASSES: dict[Schedule, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleZBVZeroBubble",
}
# Schedules that run several stages per pp rank (torch's PipelineScheduleMulti); the others run one.
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
# How stages are placed on pp ranks. torch's schedules derive the same map on their own
# (stage_index_to_group_rank) to address their sends; the layout tests check that the two agree.
PLACEMENT = {"zero_bubble": "v"}  # every other schedule: "loop"


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stage indices rank `pp_rank` holds, in the order its parts are built and handed to torch."""
    if PLACEMENT.get(schedule, "loop") == "v":
        # Down the ranks and back up: rank r holds stage r, then 2*pp-1-r, then 2*pp+r, ...
        return [k * pp + (pp_rank if k % 2 == 0 else pp - 1 - pp_rank) for k in range(stages_per_rank)]
    return [k * pp + pp_rank for k in range(stages_per_rank)]


def stages_problem(pp: int, stages_per_rank: int, n_layers: int) -> str | None:
    """Why pp x stages_per_rank stages cannot split `n_layers` blocks (each stage needs one), or None."""
    n_stages = pp * stages_per_rank
    if n_stages > n_layers:
        return (
            f"parallelism: pp={pp} x stages_per_rank={stages_per_rank} = {n_stages} stages, but model.n_layers="
            f"{n_layers}: lower pp or stages_per_rank so that each stage gets at least one block"
        )
    return None


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """Blocks of one stage: contiguous and as even as possible, earlier stages taking the remainder
    (the last stage also carries the output head, the largest single matmul). The caller has checked
    stages_problem: with fewer blocks than stages some stages would get none."""
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def schedule_problem(pp: int, microbatches: int, schedule: str, stages_per_rank: int) -> str | None:
    """Why torch's pipeline schedules (2.13) cannot run these settings with `pp` ranks, or None."""
    mb, spr = microbatches, stages_per_rank
    if spr > 1 and schedule not in MULTI_STAGE_SCHEDULES:
        return (
            f"stages_per_rank={spr} needs a schedule that runs several stages per rank: set pp_schedule: "
            f"interleaved_1f1b, or stages_per_rank: 1 (pp_schedule is {schedule})"
        )
    if pp == 1:
        if spr > 1:
            return f"stages_per_rank={spr} splits the model over pipeline ranks: set pp > 1, or stages_per_rank: 1"
        return None
    if schedule == "zero_bubble" and spr != 2:
        return (
            f"pp_schedule zero_bubble (torch's ZBVZeroBubble) runs exactly 2 stages per rank, in a V: "
            f"set stages_per_rank: 2 (it is {spr})"
        )
    if mb < pp:
        return f"microbatches={mb} must be >= pp={pp} to fill the pipeline"
    rounds = mb // pp
    if schedule == "interleaved_1f1b" and mb % rounds:
        # torch runs the microbatches in mb // pp rounds and needs them to divide evenly.
        lower, upper = rounds * pp, (rounds + 1) * pp
        return (
            f"microbatches={mb} with pp_schedule interleaved_1f1b and pp={pp}: torch runs them in "
            f"{rounds} rounds and needs microbatches divisible by that: use a multiple of pp ({lower} or {upper})"
        )
    return None


def microbatch_problem(local_batch: int, microbatches: int) -> str | None:
    """Why a pipeline cannot split the local batch into `microbatches` equal ones, or None."""
    if local_batch % microbatches:
        return f"train.local_batch_size={local_batch} is not divisible by parallelism.microbatches={microbatches}"
    return None
