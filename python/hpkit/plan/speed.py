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
from hpkit.layout_rules.pipeline import stage_ids, stage_layers
from hpkit.plan.kernels import HPKIT, MATMULS, TrainingLoop, sdpa_kernel

if TYPE_CHECKING:
    from hpkit.models.llama.shape import ModelShape
    from hpkit.plan.layout import Layout

# The fraction of the data sheet's dense peak that a large bf16/tf32 GEMM reaches: cuBLAS on H100 SXM and A100
# reaches 70-80 % on the square-ish GEMMs of a transformer block (NVIDIA's published cuBLAS figures).
# Checked, not fitted, by tests/unit/test_plan_published.py.
MATMUL_EFFICIENCY = 0.7
# The fraction of the dense peak that FlashAttention-2 (torch's SDPA flash kernel) reaches, forward and backward
# together, on the causal half it computes: 330-350 TFLOP/s of 989 on H100 at head dim 128, a little less at 64
# (Shah et al., "FlashAttention-3", 2024, figures 5-6, FlashAttention-2's curves). The memory-efficient kernel
# is slower; math runs the scores as plain bmm (MATMUL_EFFICIENCY) over the whole S x S.
ATTENTION_EFFICIENCY = {"flash": 0.34, "efficient": 0.25, "math": MATMUL_EFFICIENCY, "cpu_flash": 1.0}
# The share of HBM's data-sheet bandwidth that torch's elementwise and reduction kernels stream at (~80-90 % on
# A100/H100 for large vectorised kernels).
HBM_EFFICIENCY = 0.8
# Selective checkpointing runs every op of a block's forward, and again of its recompute, through a Python
# TorchDispatchMode (torch.utils.checkpoint's SAC): a CPU cost per op that the GPU waits for. FITTED to the
# row "hpkit-h100-1b-gpu-mfu-selective" of tests/fixtures/published_gpu_runs.json (144 ms a step against 100 ms
# without checkpointing, less the recompute the model counts); the only fitted constant of the GPU model.
SAC_OP_OVERHEAD_S = 25e-6
# aten ops in one block's forward (matmuls, norms, rotary's casts and complex multiply, views, attention,
# SwiGLU, residual adds): what SAC's dispatch mode sees.
OPS_PER_BLOCK_FORWARD = 45
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
    # A GPU: eager kernels counted one by one (elementwise bytes, flash attention, the loss's passes, FSDP's
    # copies); off for a calibrated CPU rank, whose figures bench/bench_plan_ranking.py measures as a whole.
    gpu: bool = False


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
        gpu=True,
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


@dataclass(frozen=True)
class _Step:
    """One step's constants, read once from the layout."""

    shape: ModelShape
    layout: Layout
    hw: Hardware
    seq: int
    loop: TrainingLoop

    @property
    def act(self) -> int:
        return 2 if self.layout.precision == "bf16" else 4

    @property
    def mbs(self) -> int:
        return self.layout.microbatches if self.layout.pp > 1 else 1

    @property
    def tokens_mb(self) -> float:
        return self.layout.local_batch_size / self.mbs * self.seq  # tokens of one forward

    @property
    def spr(self) -> int:
        return self.layout.stages_per_rank if self.layout.pp > 1 else 1

    @property
    def n_stages(self) -> int:
        return self.layout.pp * self.spr

    @property
    def stream(self) -> int:
        """Bytes per element of the residual stream: bf16 under FSDP's param_dtype, fp32 under autocast."""
        return 2 if self.layout.precision == "bf16" and self.layout.fsdp_enabled else 4

    @property
    def streamed_bw(self) -> float:
        return self.hw.mem_bw * (HBM_EFFICIENCY if self.hw.gpu else 1.0)


def predict(
    shape: ModelShape, layout: Layout, hw: Hardware, seq_len: int | None = None, loop: TrainingLoop = HPKIT
) -> SpeedPlan:
    """One step of `layout` training `shape` on `hw`, per GPU, run by `loop` (hpkit's runtime by default)."""
    st = _Step(shape, layout, hw, shape.seq_len if seq_len is None else seq_len, loop)
    compute, bubble, blocks, busiest = _compute(st)
    tp_s, ep_s, pp_s = _exposed_collectives(st, blocks)
    fsdp, ddp = _data_parallel(st, blocks, busiest, compute)
    parts = {
        "compute": compute,
        "bubble": bubble,
        "tp": tp_s,
        "ep": ep_s,
        "pp": pp_s,
        "fsdp": fsdp,
        "ddp": ddp,
        "optimizer": _optimizer_s(st, blocks, busiest),
    }
    step = sum(parts.values())
    tps = layout.global_batch * st.seq / step / layout.world
    flops = shape.flops_per_token(st.seq) * tps
    return SpeedPlan(
        step_s=step,
        tokens_per_s_per_gpu=tps,
        mfu=flops / hw.peak_flops,
        tflops_per_gpu=flops / 1e12,
        parts={k: v for k, v in parts.items() if v > 0},
    )


def _matmuls(st: _Step, block: int) -> dict[str, tuple[float, float]]:
    """A dense block's matmuls on this rank's tp shard: name -> (k, n) of its (tokens x k) @ (k x n)."""
    shape, tp = st.shape, st.layout.tp
    dm, q, kv = shape.dim, shape.n_heads * shape.hd / tp, shape.n_kv_heads * shape.hd / tp
    out = {"wq": (dm, q), "wk": (dm, kv), "wv": (dm, kv), "wo": (q, dm)}
    if not shape.is_moe_block(block):
        f = shape.ffn_dim / tp
        out |= {"w1": (dm, f), "w3": (dm, f), "w2": (f, dm)}
    return out


def _moe_ffn_s(st: _Step, block: int) -> float:
    shape, hw, tp, ep, act = st.shape, st.hw, st.layout.tp, st.layout.ep, st.act
    hidden, experts, top_k = shape.expert_hidden, shape.experts or 1, shape.top_k or 1
    dm, t = shape.dim, 0.0
    # Balanced routing: the ep group's tokens x top_k spread evenly over all experts.
    per_expert = st.tokens_mb * top_k * ep / experts
    for _ in range(max(1, experts // ep)):
        t += _gemm_s(hw, per_expert, dm, 2 * hidden / tp, act)
        t += _gemm_s(hw, per_expert, hidden / tp, dm, act)
    if shape.shared_experts:
        t += _gemm_s(hw, st.tokens_mb, dm, 2 * hidden * shape.shared_experts / tp, act)
        t += _gemm_s(hw, st.tokens_mb, hidden * shape.shared_experts / tp, dm, act)
    return t


def _attention_s(st: _Step) -> float:
    """Scores and values of one block, forward and backward: on a GPU the causal half the kernel computes, at
    its kernel's efficiency; on a calibrated CPU the step line's whole 12 x heads x head_dim x seq."""
    shape, hw = st.shape, st.hw
    full = 12 * shape.n_heads / st.layout.tp * shape.hd * st.seq * st.tokens_mb
    if not hw.gpu:
        return full / hw.matmul_flops
    row = catalog.lookup(hw.name)
    gqa = shape.n_kv_heads != shape.n_heads
    kernel = sdpa_kernel("cuda", st.layout.precision, shape.hd, gqa=gqa, gpu=row.gpu if row else "")
    causal = 1.0 if kernel == "math" else 0.5  # math computes the masked half too
    return full * causal / (hw.peak_flops * ATTENTION_EFFICIENCY[kernel])


def _elementwise_bytes(st: _Step, block: int) -> float:
    """A GPU's eager elementwise traffic of one block's forward, per token (backward moves about twice it):
    the two norms (torch's fused rms_norm: read, write; a Python RMSNorm in fp32: seven kernels), autocast's
    casts of the norm outputs, rotary (fp32 copy, complex multiply, cast back) of q and k, GQA's repeated k and
    v where the loop repeats them, the residual adds, SwiGLU's silu and product."""
    shape, tp, s, a = st.shape, st.layout.tp, st.stream, st.act
    h = shape.dim
    q, kv = shape.n_heads * shape.hd / tp, shape.n_kv_heads * shape.hd / tp
    f = (
        shape.expert_hidden * ((shape.top_k or 0) + (shape.shared_experts or 0))
        if shape.is_moe_block(block)
        else shape.ffn_dim / tp
    )
    norm = 2 * s * h if st.loop.fused_norm else (4 * s + 28) * h
    casts = 5 * (4 + 2) * h if s == 4 and a == 2 else 0.0  # 3 attention inputs, 2 SwiGLU inputs
    rope = (16 + 2 * a) * (q + kv)
    repeat = 2 * (a * kv + a * q) if st.loop.repeats_kv and kv != q else 0.0
    adds = 2 * (2 * s + a) * h
    swiglu = 5 * a * f
    return 2 * norm + casts + rope + repeat + adds + swiglu


def _block_s(st: _Step, block: int) -> float:
    """One block, one microbatch, forward and backward, with what checkpointing recomputes."""
    shape, hw, act, tokens = st.shape, st.hw, st.act, st.tokens_mb
    mms = _matmuls(st, block)
    gemm = {name: _gemm_s(hw, tokens, k, n, act) for name, (k, n) in mms.items()}
    t = sum(gemm.values()) + _attention_s(st)
    if shape.is_moe_block(block):
        t += _moe_ffn_s(st, block)
    ac = st.layout.activation_checkpoint
    if not hw.gpu:
        return _cpu_block_rest(st, t, ac)
    forward_elementwise = _elementwise_bytes(st, block) * tokens / st.streamed_bw
    t += 3 * forward_elementwise + OPS_PER_BLOCK * hw.op_overhead_s
    if ac == "full":  # the whole forward again: a third of the GEMMs, and of attention (fwd ~ bwd / 2)
        t += sum(gemm.values()) / 3 + _attention_s(st) / 3 + forward_elementwise
    elif ac == "selective":
        kept = st.loop.selective.kept_matmuls
        t += sum(g / 3 for name, g in gemm.items() if name in MATMULS and name not in kept)
        t += forward_elementwise + 2 * OPS_PER_BLOCK_FORWARD * SAC_OP_OVERHEAD_S
    return t


def _cpu_block_rest(st: _Step, matmul_s: float, ac: str) -> float:
    """A calibrated CPU rank: elementwise traffic as ELEMENTWISE_TENSORS of the model dim, the per-op floor,
    full checkpointing as a third more of everything (bench/bench_plan_ranking.py's model)."""
    hw, tokens, dm, act = st.hw, st.tokens_mb, st.shape.dim, st.act
    t = matmul_s + ELEMENTWISE_TENSORS * tokens * dm * act / hw.mem_bw + OPS_PER_BLOCK * hw.op_overhead_s
    if st.layout.tp > 1:
        t += TP_LINEARS_PER_BLOCK * hw.tp_op_overhead_s
    if ac == "selective":  # keeps matmul outputs, recomputes the rest of the forward
        t += ELEMENTWISE_TENSORS / 3 * tokens * dm * act / hw.mem_bw + OPS_PER_BLOCK / 3 * hw.op_overhead_s
    return t * (4 / 3 if ac == "full" else 1.0)


def _head_s(st: _Step) -> float:
    """Output projection (vocabulary-sharded under tp) and the loss over its logits: on a GPU the loss's passes
    one by one (the fp32 upcast, log-softmax's two reads and a write, nll's gradient, log-softmax's backward,
    the cast back: 40 bytes a logit under bf16, 28 under fp32)."""
    shape, hw, tokens = st.shape, st.hw, st.tokens_mb
    v = shape.vocab_size / st.layout.tp
    gemm = _gemm_s(hw, tokens, shape.dim, v, st.act)
    if not hw.gpu:
        return gemm + 4 * tokens * v * 4 / hw.mem_bw
    return gemm + (40 if st.act == 2 else 28) * tokens * v / st.streamed_bw


def _compute(st: _Step) -> tuple[float, float, list[int], list[int]]:
    """(compute, bubble, the busiest rank's blocks, its stages): every dense block costs the same, and every
    MoE block; one of each is timed."""
    shape, layout, hw = st.shape, st.layout, st.hw
    moe_blocks = shape.moe_blocks()
    moe_block = _block_s(st, moe_blocks[0]) if moe_blocks else 0.0
    dense_ids = [b for b in range(shape.n_layers) if not shape.is_moe_block(b)]
    dense_block = _block_s(st, dense_ids[0]) if dense_ids else 0.0
    head = _head_s(st)

    ranks = [stage_ids(r, layout.pp, st.spr, layout.pp_schedule) for r in range(layout.pp)]
    per_rank = []
    for stages in ranks:
        blocks = [b for s in stages for b in stage_layers(shape.n_layers, st.n_stages, s)]
        t = sum(moe_block if shape.is_moe_block(b) else dense_block for b in blocks)
        t += head if st.n_stages - 1 in stages else 0.0
        per_rank.append(t * st.mbs)
    compute = max(per_rank)
    busiest = ranks[per_rank.index(compute)]
    bubble = compute * bubble_fraction(layout.pp_schedule, layout.pp, st.mbs, st.spr)
    if hw.shared_cores:
        compute, bubble = sum(per_rank) / len(per_rank), 0.0
    blocks = [b for s in busiest for b in stage_layers(shape.n_layers, st.n_stages, s)]
    return compute, bubble, blocks, busiest


def _exposed_collectives(st: _Step, blocks: list[int]) -> tuple[float, float, float]:
    """TP's all-reduces (2 forward, 2 backward per block, 2 more forward under full AC; as reduce-scatter +
    all-gather under sequence parallel: the same bytes), EP's all-to-alls (dispatch and combine, each way), PP's
    activation and gradient sends; all exposed."""
    shape, layout, hw = st.shape, st.layout, st.hw
    tp, ep = layout.tp, layout.ep
    act_bytes = st.tokens_mb * shape.dim * st.act
    again = 2 if layout.activation_checkpoint == "full" else 0
    tp_s = ((4 + again) * len(blocks) + 2) * all_reduce_s(act_bytes, tp, group_link(hw, 1, tp)) * st.mbs
    moe_here = sum(1 for b in blocks if shape.is_moe_block(b))
    ep_link = group_link(hw, tp, ep)
    ep_s = (4 + again) * moe_here * all_to_all_s(act_bytes * (shape.top_k or 1) / tp, ep, ep_link) * st.mbs
    pp_link = group_link(hw, tp * ep * layout.dp_shard * layout.dp_replicate, layout.pp)
    pp_s = 2 * st.mbs * st.spr * send_s(act_bytes / tp, pp_link) if layout.pp > 1 else 0.0
    return tp_s, ep_s, pp_s


def _local_weights(st: _Step, blocks: list[int], busiest: list[int]) -> tuple[float, float]:
    """(dense, routed) weights of this rank's stages after TP and EP, before FSDP."""
    shape = st.shape
    routed = sum(shape.routed_expert_params() for b in blocks if shape.is_moe_block(b))
    dense = float(sum(shape.block_params(b) for b in blocks) - routed)
    dense += shape.vocab_size * shape.dim * ((0 in busiest) + (st.n_stages - 1 in busiest))
    return dense / st.layout.tp, routed / st.layout.ep / st.layout.tp


def _data_parallel(st: _Step, blocks: list[int], busiest: list[int], compute: float) -> tuple[float, float]:
    """(FSDP, DDP) exposed seconds. FSDP gathers each unit forward, and again backward when it reshards after
    forward (not under PP); it reduce-scatters the gradients once a step; HSDP adds an all-reduce of the shards
    across replicas; DDP all-reduces whole gradients in buckets. On a GPU FSDP's copy-in/out of each gathered and
    reduced unit is HBM traffic on the compute stream."""
    layout, hw = st.layout, st.hw
    tp, ep, dp_shard, dp_rep = layout.tp, layout.ep, layout.dp_shard, layout.dp_replicate
    param_bytes, grad_bytes = st.act, 4  # FSDP2 gathers in param_dtype and reduces in float32
    fsdp_link = group_link(hw, tp, dp_shard * ep)
    expert_fsdp_link = group_link(hw, tp * ep, dp_shard)
    rep_link = group_link(hw, tp * ep * dp_shard, dp_rep)
    dense_tp, experts_tp = _local_weights(st, blocks, busiest)
    units = len(blocks) + 2
    fsdp_n, expert_n = layout.fsdp_shards, layout.expert_fsdp_shards
    gathers = 1 if layout.pp > 1 else 2
    fsdp_s = ddp_s = copies = 0.0
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
        if hw.gpu and fsdp_n > 1:
            # Copy-out of each gather (read, write in param_dtype), copy-in of each reduce (read bf16, write fp32).
            copies = (dense_tp + experts_tp) * (gathers * 2 * param_bytes + param_bytes + grad_bytes)
            copies /= st.streamed_bw
    elif layout.ddp_enabled:
        ddp_s = all_reduce_s((dense_tp + experts_tp) * grad_bytes, dp_rep, rep_link)
    if hw.overlap:
        # Prefetch hides a unit's gather behind the previous unit's compute; the first one waits. DDP's
        # buckets overlap the backward (two thirds of the compute).
        fsdp_exposed = max(fsdp_s / units, fsdp_s - compute)
        ddp_exposed = max(ddp_s / units, ddp_s - compute * 2 / 3)
    else:
        fsdp_exposed, ddp_exposed = fsdp_s, ddp_s
    return fsdp_exposed + copies, ddp_exposed


def _optimizer_s(st: _Step, blocks: list[int], busiest: list[int]) -> float:
    """AdamW over the local shard (memory-bound), the gradient norm's read of every gradient, and under autocast
    (no FSDP) its per-step bf16 casts of the weights and the fp32 casts of their gradients."""
    layout, hw = st.layout, st.hw
    dense_tp, experts_tp = _local_weights(st, blocks, busiest)
    local = dense_tp / layout.fsdp_shards + experts_tp / layout.expert_fsdp_shards
    per_param = OPTIMIZER_BYTES_PER_PARAM
    if hw.gpu:
        per_param += 4  # the gradient norm
        if layout.precision == "bf16" and not layout.fsdp_enabled:
            per_param += 6 + 6  # autocast: weight fp32 -> bf16 each step; gradient bf16 -> fp32
    return local * per_param / st.streamed_bw + 2 * OPS_PER_BLOCK * hw.op_overhead_s
