"""The planner's speed model: one training step's time on one layout, from FLOPs and the collectives it issues.

A step's time per GPU is the sum of
- compute: each block's matmuls on a roofline (FLOPs at the GPU's achievable peak, or bytes at its memory
  bandwidth, or a floor per operator: the launch/dispatch cost that small models meet), the elementwise
  traffic, the recompute that activation checkpointing adds, stretched by the pipeline's bubble;
- the collectives of the layout, each over the link its group crosses (`Link`): FSDP's all-gathers and
  reduce-scatters and HSDP's all-reduce (hidden behind compute where the hardware overlaps them, except the
  first unit's), DDP's all-reduce, TP's all-reduces (exposed), PP's sends and EP's all-to-alls (exposed);
- the optimizer step (memory-bound).
Its output is tokens/s per GPU and MFU against the catalog's peak, the same FLOP count the step line uses
(`ModelShape.flops_per_token`). The constants below are named so that a GPU run can calibrate them.
Torch-free: it runs on a login node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpkit import catalog
from hpkit.plan.memory import stage_ids, stage_layers

if TYPE_CHECKING:
    from hpkit.plan.layout import Layout
    from hpkit.plan.shapes import ModelShape

# The fraction of the data sheet's dense peak that a large bf16/tf32 GEMM reaches (cuBLAS on H100 and A100
# reaches 70-80 %); to be calibrated on a lent GPU.
MATMUL_EFFICIENCY = 0.7
# Alpha of the alpha-beta collective model, seconds per ring step: NCCL inside a node, and across EFA.
LATENCY_INTRA_S = 10e-6
LATENCY_INTER_S = 30e-6
# Each operator's launch: the floor under any kernel's time (small models meet it).
OP_OVERHEAD_S = 5e-6
# Elementwise bytes (reads + writes) per token per block per unit of `dim`, forward and backward together
# (norms, RoPE, softmax outside flash attention, SwiGLU's product, residual adds): ~24 tensors of dim.
ELEMENTWISE_TENSORS = 24
# Operators per block, forward and backward (matmuls counted apart): the floor per block.
OPS_PER_BLOCK = 40
# The tensor-parallel linears of a block: wq, wk, wv, wo, w1, w2, w3.
TP_LINEARS_PER_BLOCK = 7
# AdamW's bytes per local parameter: fp32 param, grad, two moments read; param and moments written.
OPTIMIZER_BYTES_PER_PARAM = 28
# ZB-H1's bubble is a third of 1F1B's (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).
ZERO_BUBBLE_FACTOR = 1 / 3


@dataclass(frozen=True)
class Hardware:
    """What one GPU (or one CPU rank, calibrated) and its links can do."""

    name: str
    gpus_per_node: int
    peak_flops: float  # FLOP/s per GPU at the precision: the MFU denominator
    matmul_flops: float  # FLOP/s a large GEMM reaches
    mem_bw: float  # bytes/s per GPU
    intra_bw: float  # bytes/s per GPU to its node's other GPUs, one way
    inter_bw_node: float  # bytes/s of a whole node to other nodes
    latency_intra_s: float = LATENCY_INTRA_S
    latency_inter_s: float = LATENCY_INTER_S
    op_overhead_s: float = OP_OVERHEAD_S
    overlap: bool = True  # collectives run beside compute (GPU streams); gloo on CPU shares the cores: no
    # A tensor-parallel linear's dispatch (DTensor) beyond a plain one's, forward and backward: hidden behind a
    # GPU's kernels (0), paid in full by a CPU rank (measured by bench/bench_plan_ranking.py's probe).
    tp_op_overhead_s: float = 0.0
    # Each FSDP unit's collective beyond its bytes and latency: FSDP2's copy-in/out and hooks (and on gloo, a
    # reduce-scatter run as a whole all-reduce). Hidden on GPUs (0); measured on CPU ranks by the same probe.
    fsdp_collective_overhead_s: float = 0.0
    # Ranks share fewer cores than there are ranks (CPU runs): a waiting rank's core goes to another, so a
    # pipeline's bubble costs no time and the step is the ranks' mean work, not the busiest rank's.
    shared_cores: bool = False


def hardware_for(instance_type: str, precision: str, inter_node_gbs: float | None = None) -> Hardware:
    """The catalog's figures for `instance_type`; `inter_node_gbs` (GB/s per node, measured by `hpkit check
    --all-nodes --bandwidth`) replaces its EFA figure. KeyError naming what the catalog lacks."""
    row = catalog.lookup(instance_type)
    links = catalog.links(instance_type)
    if row is None or not row.is_gpu:
        raise KeyError(f"{instance_type} is not a GPU instance type the catalog knows")
    peak = catalog.peak_tflops_for(row.gpu, precision)
    if links is None or peak is None:
        raise KeyError(f"the catalog has no peak or link figures for {instance_type}")
    inter = inter_node_gbs * 1e9 if inter_node_gbs else links.efa_gbps / 8 * 1e9
    return Hardware(
        name=catalog.normalise(instance_type),
        gpus_per_node=row.gpus,
        peak_flops=peak * 1e12,
        matmul_flops=peak * 1e12 * MATMUL_EFFICIENCY,
        mem_bw=links.hbm_gbs * 1e9,
        intra_bw=links.nvlink_gbs * 1e9,
        inter_bw_node=inter,
    )


@dataclass(frozen=True)
class Link:
    bw: float  # bytes/s
    latency_s: float
    crosses_nodes: bool


def group_link(hw: Hardware, stride: int, size: int) -> Link:
    """The link a group of `size` ranks, `stride` apart in the global rank order, crosses.

    Inside a node: NVLink. Across nodes the node's network is shared by its GPUs, each in a group of its
    own; a group with m members per node moves its data across the node boundary once per ring, so each
    GPU sees m/gpus_per_node of the node's bandwidth.
    """
    if size <= 1 or stride * size <= hw.gpus_per_node:
        return Link(hw.intra_bw, hw.latency_intra_s, False)
    per_node = max(1, hw.gpus_per_node // stride)
    return Link(min(hw.intra_bw, hw.inter_bw_node / hw.gpus_per_node * per_node), hw.latency_inter_s, True)


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of `nbytes` in all (nccl-tests' S)."""
    return 0.0 if n <= 1 else (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bw


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bw


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of each rank's `nbytes` send buffer."""
    return 0.0 if n <= 1 else (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bw


def send_s(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bw


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle time of a pipeline rank as a fraction of its busy time."""
    if pp <= 1:
        return 0.0
    base = (pp - 1) / microbatches
    if schedule == "interleaved_1f1b":
        return base / stages_per_rank
    if schedule == "zero_bubble":
        return base / stages_per_rank * ZERO_BUBBLE_FACTOR
    return base  # gpipe, 1f1b


@dataclass(frozen=True)
class SpeedPlan:
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    tflops_per_gpu: float
    parts: dict[str, float] = field(default_factory=dict)  # seconds per step, by what spends them

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": round(self.step_s, 6),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 2),
            "mfu": round(self.mfu, 4),
            "tflops_per_gpu": round(self.tflops_per_gpu, 2),
            "parts_s": {k: round(v, 6) for k, v in self.parts.items()},
        }


def _gemm_s(hw: Hardware, m: float, k: float, n: float, nbytes: int) -> float:
    """Forward and both backward GEMMs of an (m x k) @ (k x n) on the roofline, with the operator floor."""
    flops = 2 * m * k * n
    traffic = (m * k + k * n + m * n) * nbytes
    return 3 * max(flops / hw.matmul_flops, traffic / hw.mem_bw, hw.op_overhead_s)


def predict(shape: ModelShape, layout: Layout, hw: Hardware, seq_len: int | None = None) -> SpeedPlan:
    """One step of `layout` training `shape` on `hw`, per GPU."""
    seq = shape.seq_len if seq_len is None else seq_len
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    dp_shard, dp_rep = layout.dp_shard, layout.dp_replicate
    act = 2 if layout.precision == "bf16" else 4
    param_bytes = act  # FSDP2 gathers in param_dtype
    grad_bytes = 4  # and reduces in float32 (hpkit.runtime.fsdp.mixed_precision_policy)
    mbs = layout.microbatches if pp > 1 else 1
    tokens_mb = layout.local_batch_size / mbs * seq  # tokens of one forward
    ac = layout.activation_checkpoint
    recompute = 4 / 3 if ac == "full" else 1.0  # full AC runs each block's forward twice
    spr = layout.stages_per_rank if pp > 1 else 1
    n_stages = pp * spr

    # Links, from the mesh order (pp, dp_replicate, dp_shard, ep, tp): tp innermost.
    tp_link = group_link(hw, 1, tp)
    ep_link = group_link(hw, tp, ep)
    fsdp_link = group_link(hw, tp, dp_shard * ep)
    expert_fsdp_link = group_link(hw, tp * ep, dp_shard)
    rep_link = group_link(hw, tp * ep * dp_shard, dp_rep)
    pp_link = group_link(hw, tp * ep * dp_shard * dp_rep, pp)

    def block_s(block: int) -> float:
        """One block, one microbatch, forward and backward, on this rank's tp shard."""
        hd, dm = shape.hd, shape.dim
        t = _gemm_s(hw, tokens_mb, dm, (shape.n_heads + 2 * shape.n_kv_heads) * hd / tp, act)
        t += _gemm_s(hw, tokens_mb, shape.n_heads * hd / tp, dm, act)
        if shape.is_moe_block(block):
            hidden, experts, top_k = shape.expert_hidden, shape.experts or 1, shape.top_k or 1
            # Balanced routing: the ep group's tokens x top_k spread evenly over all experts.
            per_expert = tokens_mb * top_k * ep / experts
            for _ in range(max(1, experts // ep)):
                t += _gemm_s(hw, per_expert, dm, 2 * hidden / tp, act)
                t += _gemm_s(hw, per_expert, hidden / tp, dm, act)
            if shape.shared_experts:
                t += _gemm_s(hw, tokens_mb, dm, 2 * hidden * shape.shared_experts / tp, act)
                t += _gemm_s(hw, tokens_mb, hidden * shape.shared_experts / tp, dm, act)
        else:
            t += _gemm_s(hw, tokens_mb, dm, 2 * shape.ffn_dim / tp, act)
            t += _gemm_s(hw, tokens_mb, shape.ffn_dim / tp, dm, act)
        # Attention scores and values: the step line's 12 * heads * head_dim * seq FLOPs per token.
        t += 12 * shape.n_heads / tp * hd * seq * tokens_mb / hw.matmul_flops
        t += ELEMENTWISE_TENSORS * tokens_mb * dm * act / hw.mem_bw
        t += OPS_PER_BLOCK * hw.op_overhead_s
        if tp > 1:
            t += TP_LINEARS_PER_BLOCK * hw.tp_op_overhead_s
        if ac == "selective":  # keeps matmul outputs, recomputes the rest of the forward
            t += (
                ELEMENTWISE_TENSORS / 3 * tokens_mb * dm * act / hw.mem_bw
                + OPS_PER_BLOCK / 3 * hw.op_overhead_s
            )
        return t * recompute

    def head_s() -> float:
        """Output projection (vocabulary-sharded under tp) and the loss over its fp32 logits."""
        return _gemm_s(hw, tokens_mb, shape.dim, shape.vocab_size / tp, act) + (
            4 * tokens_mb * shape.vocab_size / tp * 4 / hw.mem_bw
        )

    # Every dense block costs the same, and every MoE block: one of each, counted per rank.
    moe_blocks = shape.moe_blocks()
    moe_block = block_s(moe_blocks[0]) if moe_blocks else 0.0
    dense_ids = [b for b in range(shape.n_layers) if not shape.is_moe_block(b)]
    dense_block = block_s(dense_ids[0]) if dense_ids else 0.0

    def blocks_s(blocks: list[int]) -> float:
        return sum(moe_block if shape.is_moe_block(b) else dense_block for b in blocks)

    ranks = [stage_ids(r, pp, spr, layout.pp_schedule) for r in range(pp)]
    per_rank = []
    for stages in ranks:
        t = sum(blocks_s(stage_layers(shape.n_layers, n_stages, s)) for s in stages)
        t += head_s() if n_stages - 1 in stages else 0.0
        per_rank.append(t * mbs)
    compute = max(per_rank)
    busiest = ranks[per_rank.index(compute)]
    bubble = compute * bubble_fraction(layout.pp_schedule, pp, mbs, spr)
    if hw.shared_cores:
        compute, bubble = sum(per_rank) / len(per_rank), 0.0
    blocks = [b for s in busiest for b in stage_layers(shape.n_layers, n_stages, s)]

    # Exposed collectives: TP's all-reduces (2 forward, 2 backward per block, 2 more forward under full AC;
    # as reduce-scatter + all-gather under sequence parallel: the same bytes), EP's all-to-alls (dispatch
    # and combine, each way), PP's activation and gradient sends.
    act_bytes = tokens_mb * shape.dim * act
    again = 2 if ac == "full" else 0
    tp_s = ((4 + again) * len(blocks) + 2) * all_reduce_s(act_bytes, tp, tp_link) * mbs
    moe_here = sum(1 for b in blocks if shape.is_moe_block(b))
    ep_s = (4 + again) * moe_here * all_to_all_s(act_bytes * (shape.top_k or 1) / tp, ep, ep_link) * mbs
    pp_s = 2 * mbs * spr * send_s(act_bytes / tp, pp_link) if pp > 1 else 0.0

    # Data-parallel traffic of this rank's weights: FSDP gathers each unit forward, and again backward when
    # it reshards after forward (not under PP); it reduce-scatters the gradients once a step; HSDP adds an
    # all-reduce of the shards across replicas; DDP all-reduces whole gradients in buckets.
    routed = sum(shape.routed_expert_params() for b in blocks if shape.is_moe_block(b))
    dense = float(sum(shape.block_params(b) for b in blocks) - routed)
    dense += shape.vocab_size * shape.dim * ((0 in busiest) + (n_stages - 1 in busiest))
    dense_tp, experts_tp = dense / tp, routed / ep / tp
    units = len(blocks) + 2
    fsdp_n, expert_n = layout.fsdp_shards, layout.expert_fsdp_shards
    gathers = 1 if pp > 1 else 2
    fsdp_s = ddp_s = 0.0
    if layout.fsdp_enabled:
        fsdp_s += all_gather_s(dense_tp * (gathers * param_bytes + grad_bytes), fsdp_n, fsdp_link)
        fsdp_s += all_gather_s(experts_tp * (gathers * param_bytes + grad_bytes), expert_n, expert_fsdp_link)
        fsdp_s += all_reduce_s((dense_tp / fsdp_n + experts_tp / expert_n) * grad_bytes, dp_rep, rep_link)
        if fsdp_n > 1:  # one call per unit, each paying the ring's latency
            fsdp_s += (units - 1) * (gathers + 1) * (fsdp_n - 1) * fsdp_link.latency_s
        if dp_rep > 1:
            fsdp_s += (units - 1) * 2 * (dp_rep - 1) * rep_link.latency_s
        calls = (gathers + 1) * (fsdp_n > 1) + (dp_rep > 1)
        fsdp_s += units * calls * hw.fsdp_collective_overhead_s
    elif layout.ddp_enabled:
        ddp_s = all_reduce_s((dense_tp + experts_tp) * grad_bytes, dp_rep, rep_link)
    if hw.overlap:
        # Prefetch hides a unit's gather behind the previous unit's compute; the first one waits. DDP's
        # buckets overlap the backward (two thirds of the compute).
        fsdp_exposed = max(fsdp_s / units, fsdp_s - compute)
        ddp_exposed = max(ddp_s / units, ddp_s - compute * 2 / 3)
    else:
        fsdp_exposed, ddp_exposed = fsdp_s, ddp_s

    local = dense_tp / fsdp_n + experts_tp / expert_n
    optimizer = local * OPTIMIZER_BYTES_PER_PARAM / hw.mem_bw + 2 * OPS_PER_BLOCK * hw.op_overhead_s

    parts = {
        "compute": compute,
        "bubble": bubble,
        "tp": tp_s,
        "ep": ep_s,
        "pp": pp_s,
        "fsdp": fsdp_exposed,
        "ddp": ddp_exposed,
        "optimizer": optimizer,
    }
    step = sum(parts.values())
    tps = layout.global_batch * seq / step / layout.world
    flops = shape.flops_per_token(seq) * tps
    return SpeedPlan(
        step_s=step,
        tokens_per_s_per_gpu=tps,
        mfu=flops / hw.peak_flops,
        tflops_per_gpu=flops / 1e12,
        parts={k: v for k, v in parts.items() if v > 0},
    )
