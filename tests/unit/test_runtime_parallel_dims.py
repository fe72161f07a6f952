from __future__ import annotations

import pytest

from hpkit.errors import SpecError
from hpkit.layout_rules.pipeline import stage_ids
from hpkit.runtime.parallel.parallel_dims import ParallelDims
from hpkit.spec import ParallelismSpec


def dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_spec(ParallelismSpec(**kw), world)


def test_default_is_fsdp_over_everything():
    d = dims(8)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp) == (1, 8, 1, 1)
    assert d.fsdp_enabled and not d.ddp_enabled
    assert d.mesh_dims() == [("dp_shard", 8)]


def test_sagemaker_keys():
    d = dims(8, tensor_parallel_degree=2, pipeline_parallel_degree=2, microbatches=4, ddp=True)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == (2, 2, 1, 2)
    # Replicas next to TP/PP are FSDP2 with a one-rank shard dimension (HSDP), not DDP.
    assert d.fsdp_enabled and not d.ddp_enabled
    assert d.mesh_dims() == [("pp", 2), ("dp_replicate", 2), ("dp_shard", 1), ("tp", 2)]


def test_plain_ddp_uses_ddp():
    d = dims(4, ddp=True)
    assert d.ddp_enabled and not d.fsdp_enabled
    assert d.mesh_dims() == [("dp_replicate", 4)]


def test_single_process_mesh():
    d = dims(1)
    assert d.mesh_dims() == [("dp_shard", 1)]
    assert d.describe() == "single process"


@pytest.mark.parametrize(
    ("world", "kw", "message"),
    [
        (4, {"dp_shard": 3}, "does not divide the world size 4"),
        (8, {"dp_shard": 2, "tp": 2}, "multiply to 4, not the world size 8"),
    ],
)
def test_degrees_that_do_not_make_the_world(world, kw, message):
    with pytest.raises(SpecError, match=message):
        dims(world, **kw)


def test_every_schedule_a_spec_may_name_has_a_torch_class():
    import torch.distributed.pipelining as pipelining

    from hpkit.layout_rules.pipeline import MULTI_STAGE_SCHEDULES, SCHEDULES
    from hpkit.runtime.parallel import pipeline

    # The names and their classes sit side by side in arch: a name without a class fails here (a KeyError).
    for name in SCHEDULES:
        cls = pipeline.schedule_class(name)
        assert issubclass(cls, pipelining.schedules._PipelineSchedule), name
        # The one-stage schedules take a stage, the others a list of them.
        one_stage = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
        assert one_stage == (name not in MULTI_STAGE_SCHEDULES), name


@pytest.mark.parametrize(("schedule", "style"), [("interleaved_1f1b", "loop"), ("zero_bubble", "v")])
def test_stage_placement_is_torchs(schedule, style):
    """Each rank builds the stages that torch's schedule will send to and receive from it."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp in range(1, 5):
        for per_rank in range(1, 5):
            torch_map = generate_stage_to_rank_mapping(pp, pp * per_rank, style=style)
            ours = {s: r for r in range(pp) for s in stage_ids(r, pp, per_rank, schedule)}
            assert ours == torch_map, (pp, per_rank)


def test_inferred_pp_meets_the_schedule_rules_once_resolved():
    spec = ParallelismSpec(
        pp=-1, dp_shard=1, microbatches=4, pp_schedule="interleaved_1f1b", stages_per_rank=2
    )
    assert dims(2, **spec.model_dump()).pp == 2
    with pytest.raises(SpecError, match="parallelism: microbatches=4 must be >= pp=8"):
        dims(8, **spec.model_dump())


def test_sequence_parallel_follows_the_backend_unless_set():
    from hpkit.runtime.parallel.tensor_parallel import sequence_parallel_default

    # NCCL reduce-scatters natively; gloo would run a full all-reduce and then all-gather.
    assert sequence_parallel_default("cuda") and not sequence_parallel_default("cpu")
    assert ParallelismSpec(tp=2).sequence_parallel is None
    assert ParallelismSpec(tp=2, sequence_parallel=True).sequence_parallel is True


def test_sequence_parallel_needs_the_whole_model():
    with pytest.raises(ValueError, match="sequence_parallel applies to whole-model tensor parallel"):
        ParallelismSpec(tp=2, tp_modules=["attention"], sequence_parallel=True)
    ParallelismSpec(tp=2, tp_modules=["attention"], sequence_parallel=False)


def test_seq_len_must_divide_only_under_sequence_parallel():
    from hpkit.models.llama.model import build_model, config_for
    from hpkit.runtime.parallel.tensor_parallel import check_tp_shape

    model = build_model(config_for("debug", seq_len=30), "meta")
    check_tp_shape(model, 4, 30, whole_model=True, sequence_parallel=False)
    with pytest.raises(SpecError, match="seq_len=30"):
        check_tp_shape(model, 4, 30, whole_model=True, sequence_parallel=True)


def test_expert_parallel_is_a_mesh_dimension_that_also_splits_the_batch():
    d = dims(8, ep=2)
    assert (d.dp_shard, d.ep) == (4, 2)
    assert d.dp == 8 and d.fsdp_enabled and d.ep_enabled
    assert d.mesh_dims() == [("dp_shard", 4), ("ep", 2)]
    # ep alone still gets a (one-rank) dp_shard dimension: the experts' FSDP units live on it.
    assert dims(2, ep=2, dp_shard=1).mesh_dims() == [("dp_shard", 1), ("ep", 2)]
    assert dims(8, pp=2, ep=2, tp=2, dp_shard=1, microbatches=2).mesh_dims() == [
        ("pp", 2),
        ("dp_shard", 1),
        ("ep", 2),
        ("tp", 2),
    ]
    with pytest.raises(SpecError, match=r"dp_replicate\*dp_shard\*ep\*tp\*pp equal 6"):
        dims(6, ep=4)
