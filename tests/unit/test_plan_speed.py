"""The planner's speed model (hpkit.plan.speed): links, collectives, bubbles, and what each layout costs."""

from __future__ import annotations

import dataclasses

import pytest

from hpkit import catalog
from hpkit.models.llama.shape import shape_named
from hpkit.plan.layout import Layout
from hpkit.plan.speed import (
    MATMUL_EFFICIENCY,
    Hardware,
    Link,
    all_gather_s,
    all_reduce_s,
    bubble_fraction,
    group_link,
    hardware_for,
    predict,
)

P5 = hardware_for("p5.48xlarge", "bf16")


def test_hardware_comes_from_the_catalog_and_the_step_lines_peak() -> None:
    assert P5.gpus_per_node == 8
    assert P5.peak_flops == catalog.peak_tflops_for("H100", "bf16") * 1e12 == 989.5e12
    assert P5.intra_bw == 450e9 and P5.inter_bw_node == 3200e9 / 8
    assert hardware_for("ml.p4d.24xlarge", "fp32").peak_flops == 156e12  # tf32, as the step line's MFU
    measured = hardware_for("p5.48xlarge", "bf16", inter_node_gbs=100.0)
    assert measured.inter_bw_node == 100e9
    with pytest.raises(KeyError):
        hardware_for("c5.2xlarge", "bf16")


def test_a_group_inside_a_node_uses_nvlink_and_one_across_nodes_shares_the_network() -> None:
    assert group_link(P5, 1, 8) == Link(P5.intra_bw, P5.latency_intra_s, False)  # tp=8
    across = group_link(P5, 8, 4)  # dp over 4 nodes, one member per node: 1/8 of the node's EFA
    assert across.crosses_nodes and across.bw == pytest.approx(P5.inter_bw_node / 8)
    half = group_link(P5, 2, 8)  # 4 members per node, spanning 2 nodes
    assert half.crosses_nodes and half.bw == pytest.approx(P5.inter_bw_node / 8 * 4)
    assert group_link(P5, 1, 16).bw == pytest.approx(P5.inter_bw_node)  # all 8 per node


def test_ring_collectives_move_nccl_tests_bytes() -> None:
    link = Link(bw=1e9, latency_s=0.0, crosses_nodes=False)
    assert all_reduce_s(1e9, 4, link) == pytest.approx(2 * 3 / 4)
    assert all_gather_s(1e9, 4, link) == pytest.approx(3 / 4)
    assert all_reduce_s(1e9, 1, link) == 0.0


def test_bubbles_shrink_with_microbatches_interleaving_and_zero_bubble() -> None:
    assert bubble_fraction("1f1b", 1, 1, 1) == 0.0
    one = bubble_fraction("1f1b", 4, 8, 1)
    assert one == pytest.approx(3 / 8) == bubble_fraction("gpipe", 4, 8, 1)
    assert bubble_fraction("1f1b", 4, 16, 1) < one
    assert bubble_fraction("zero_bubble", 4, 8, 2) < bubble_fraction("interleaved_1f1b", 4, 8, 2) < one


def test_tokens_per_second_and_mfu_use_the_step_lines_flop_count() -> None:
    shape = shape_named("8B", 8192)
    plan = predict(shape, Layout(dp_shard=16, local_batch_size=1), P5)
    assert plan.tflops_per_gpu * 1e12 == pytest.approx(
        shape.flops_per_token(8192) * plan.tokens_per_s_per_gpu
    )
    assert plan.mfu == pytest.approx(plan.tflops_per_gpu * 1e12 / P5.peak_flops)
    assert 0.3 < plan.mfu <= MATMUL_EFFICIENCY  # never above what a GEMM reaches
    assert plan.step_s == pytest.approx(sum(plan.parts.values()))


def test_each_parallelism_pays_for_its_collectives() -> None:
    shape = shape_named("8B", 8192)
    fsdp = predict(shape, Layout(dp_shard=16, local_batch_size=1), P5)
    tp = predict(shape, Layout(dp_shard=8, tp=2, local_batch_size=2), P5)
    assert "tp" not in fsdp.parts and tp.parts["tp"] > 0
    pp = predict(shape, Layout(dp_shard=8, pp=2, microbatches=2, local_batch_size=2), P5)
    assert pp.parts["bubble"] > 0 and pp.parts["pp"] > 0
    more = predict(shape, Layout(dp_shard=8, pp=2, microbatches=8, local_batch_size=8), P5)
    assert more.parts["bubble"] / more.parts["compute"] < pp.parts["bubble"] / pp.parts["compute"]
    # Full checkpointing runs every forward twice: a third more compute.
    ac = predict(shape, Layout(dp_shard=16, local_batch_size=1, activation_checkpoint="full"), P5)
    assert ac.parts["compute"] == pytest.approx(fsdp.parts["compute"] * 4 / 3, rel=0.02)
    moe = shape_named("debug-moe", 256)
    ep = predict(moe, Layout(dp_shard=2, ep=4, local_batch_size=4), P5)
    assert ep.parts["ep"] > 0


def test_fsdp_traffic_is_hidden_by_overlap_and_tp_across_nodes_is_slow() -> None:
    shape = shape_named("8B", 8192)
    layout = Layout(dp_shard=64, local_batch_size=1)
    overlapped = predict(shape, layout, P5)
    serial = predict(shape, layout, dataclasses.replace(P5, overlap=False))
    assert serial.parts["fsdp"] > 5 * overlapped.parts["fsdp"]
    p4d = hardware_for("p4d.24xlarge", "bf16")  # 400 Gbit/s of EFA per node against 300 GB/s of NVLink
    inside = predict(shape, Layout(dp_shard=2, tp=8, local_batch_size=8), p4d)
    halves = dataclasses.replace(p4d, gpus_per_node=4)  # the same tp=8 now spans two nodes
    across = predict(shape, Layout(dp_shard=2, tp=8, local_batch_size=8), halves)
    assert across.parts["tp"] > 3 * inside.parts["tp"]


def test_a_calibrated_cpu_needs_no_catalog() -> None:
    cpu = Hardware(
        name="cpu",
        gpus_per_node=4,
        peak_flops=20e9,
        matmul_flops=20e9,
        mem_bw=5e9,
        intra_bw=0.2e9,
        inter_bw_node=0.2e9,
        latency_intra_s=100e-6,
        latency_inter_s=100e-6,
        op_overhead_s=30e-6,
        overlap=False,
    )
    shape = shape_named("debug", 256)
    fast = predict(shape, Layout(dp_shard=4, local_batch_size=8, precision="fp32"), cpu)
    slow = predict(shape, Layout(tp=4, local_batch_size=32, precision="fp32"), cpu)
    assert fast.tokens_per_s_per_gpu > slow.tokens_per_s_per_gpu


def test_shared_cores_fill_the_bubble_and_dtensor_dispatch_costs_tp_layouts_only() -> None:
    cpu = Hardware(
        name="cpu",
        gpus_per_node=4,
        peak_flops=10e9,
        matmul_flops=10e9,
        mem_bw=1e9,
        intra_bw=0.4e9,
        inter_bw_node=0.4e9,
        op_overhead_s=50e-6,
        overlap=False,
    )
    shape = shape_named("debug", 128)
    pipeline = Layout(pp=4, pp_schedule="gpipe", microbatches=4, local_batch_size=8, precision="fp32")
    alone = predict(shape, pipeline, cpu)
    shared = predict(shape, pipeline, dataclasses.replace(cpu, shared_cores=True))
    assert alone.parts["bubble"] > 0 and "bubble" not in shared.parts
    assert shared.step_s < alone.step_s
    tp = Layout(dp_shard=2, tp=2, local_batch_size=4, precision="fp32")
    fsdp = Layout(dp_shard=4, local_batch_size=2, precision="fp32")
    dispatch = dataclasses.replace(cpu, tp_op_overhead_s=1e-3)
    assert predict(shape, tp, dispatch).parts["compute"] > predict(shape, tp, cpu).parts["compute"] + 0.01
    assert predict(shape, fsdp, dispatch).parts["compute"] == predict(shape, fsdp, cpu).parts["compute"]
