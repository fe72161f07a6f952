"""hpkit.layout_rules: the one home of the layout rules the trainer and the planner both apply. Each rule is tested
here once, on its own function; the planner and the runtime call that function rather than a copy of it."""

from __future__ import annotations

from hpkit.layout_rules.parallel import ep_problem, tp_problem
from hpkit.layout_rules.pipeline import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    microbatch_problem,
    schedule_problem,
    stage_ids,
    stage_layers,
    stages_problem,
)
from hpkit.models.llama.shape import shape_named
from hpkit.plan.layout import Layout
from hpkit.plan.search import TRIED_SCHEDULES, runtime_problem

DIMS = {"n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048, "vocab_size": 32000, "seq_len": 30}


def test_stage_layers_cover_every_block_once():
    for n_layers in range(2, 12):
        for pp in range(1, n_layers + 1):
            stages = [stage_layers(n_layers, pp, s) for s in range(pp)]
            assert [i for s in stages for i in s] == list(range(n_layers))
            assert max(map(len, stages)) - min(map(len, stages)) <= 1
    assert [stage_layers(10, 4, s) for s in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_each_stage_needs_a_block():
    assert stages_problem(2, 3, 6) is None
    assert stages_problem(2, 3, 4) == (
        "parallelism: pp=2 x stages_per_rank=3 = 6 stages, but model.n_layers=4: lower pp or stages_per_rank "
        "so that each stage gets at least one block"
    )


def test_single_stage_schedules_hold_one_stage_per_rank():
    assert [stage_ids(r, 4, 1, "1f1b") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids(r, 4, 2, "interleaved_1f1b") for r in range(2)] == [[0, 4], [1, 5]]
    assert [stage_ids(r, 2, 2, "zero_bubble") for r in range(2)] == [[0, 3], [1, 2]]


def test_schedule_rules():
    assert schedule_problem(1, 1, "1f1b", 1) is None
    assert "needs a schedule that runs several stages" in (schedule_problem(2, 4, "1f1b", 2) or "")
    assert "exactly 2 stages per rank" in (schedule_problem(2, 4, "zero_bubble", 3) or "")
    assert schedule_problem(4, 2, "1f1b", 1) == "microbatches=2 must be >= pp=4 to fill the pipeline"
    assert "use a multiple of pp (4 or 6)" in (schedule_problem(2, 5, "interleaved_1f1b", 2) or "")
    assert set(MULTI_STAGE_SCHEDULES) < set(SCHEDULES)


def test_the_planner_tries_every_schedule_the_default_first():
    assert sorted(TRIED_SCHEDULES) == sorted(SCHEDULES)
    assert TRIED_SCHEDULES[0] == "1f1b" and TRIED_SCHEDULES[-1] == "gpipe"


def test_microbatches_must_divide_the_local_batch():
    assert microbatch_problem(4, 2) is None
    assert microbatch_problem(3, 2) == (
        "train.local_batch_size=3 is not divisible by parallelism.microbatches=2"
    )


def test_tp_must_divide_every_split_dimension_and_names_them_all():
    assert tp_problem(4, **DIMS) is None
    assert tp_problem(8, **DIMS) == "parallelism.tp=8 must divide n_heads=12, n_kv_heads=4"
    # The sequence is split only by whole-model sequence parallel, the vocabulary only by whole-model TP.
    assert tp_problem(4, **DIMS, sequence_parallel=True) == (
        "parallelism.tp=4 must divide seq_len=30 (sequence parallel splits it)"
    )
    assert tp_problem(4, **DIMS, whole_model=False, sequence_parallel=True) is None
    odd_vocab = DIMS | {"vocab_size": 32001}
    assert tp_problem(2, **odd_vocab) == "parallelism.tp=2 must divide vocab_size=32001"
    assert tp_problem(2, **odd_vocab, whole_model=False) is None


def test_ep_must_divide_the_experts():
    assert ep_problem(4, 8) is None
    assert ep_problem(3, 8) == (
        "parallelism.ep=3 must divide model.moe.experts=8: each ep rank holds experts / ep of them"
    )


def test_the_planner_rejects_what_the_trainer_refuses():
    """Layouts the search never builds itself (it picks microbatches that divide the local batch), so only
    runtime_problem stands between them and a plan that the trainer would refuse."""
    shape = shape_named("125M", 2048)
    torn = Layout(pp=2, microbatches=2, local_batch_size=3)
    assert runtime_problem(shape, torn, 8) == microbatch_problem(3, 2)
    assert runtime_problem(shape, Layout(tp=8, dp_shard=1), 8) == tp_problem(8, **shape.tp_dims())
    assert runtime_problem(shape, Layout(pp=2, microbatches=2, local_batch_size=2), 8) is None
