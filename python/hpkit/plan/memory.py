"""Peak memory per rank of a layout, from the parts that make it, as the runtime (hpkit.runtime) allocates them.

Every rank of a pipeline rank's row holds the same tensors (tp, ep and dp shards are equal up to FSDP's
padding, which is counted), so the plan has one entry per pp rank. The parts:

- params, grads, optimizer: fp32 master weights in every precision (FSDP2's MixedPrecisionPolicy casts a
  copy to bf16 for compute and reduces gradients in fp32; without FSDP, autocast casts per op), so 4 bytes
  per local element each, AdamW's two moments 8 more. Local elements: TP shards attention, dense FFNs,
  embeddings and head; EP splits routed experts; FSDP shards what is left over dp_shard x ep (dense) or
  dp_shard (experts), padding each weight's first dimension to the shard count.
- fsdp_unsharded: the compute copies of the weights. FSDP2 all-gathers a unit (a block; the embeddings; the
  head) before its forward and reshards it after, except the last block and the head, and prefetches the next
  unit in backward; under a pipeline nothing reshards (every microbatch would all-gather again) and the
  unsharded gradients accumulate in fp32 until the last microbatch. Without FSDP under bf16, autocast's cache
  keeps a bf16 copy of every weight for the step.
- activations: what each block saves for backward, per token, under none/selective/full checkpointing, times
  the blocks on the stage and the microbatches its pipeline schedule keeps in flight; plus the transient of
  the block being recomputed (checkpointing) or run.
- logits_loss: the output head's logits, their fp32 copy and log-softmax, on the rank with the last stage.
- moe_buffers: routing (router scores, one-hot slots) and the token copies the experts' dispatch makes.
- comm_buffers: a pipeline stage's receive buffers (one per microbatch, each direction).
- buffers: the rotary tables (every part holds them) and MoE counters.
- fixed: CUDA context, NCCL, fragmentation (hpkit.plan.fixed_costs), zero on CPUs.

The activation coefficients below were measured with torch's MemTracker on this runtime's blocks (CPU);
tests/integration/test_plan_memory_measured.py keeps them honest for every layout the runtime trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from hpkit.plan.fixed_costs import fixed_costs
from hpkit.plan.layout import Layout
from hpkit.plan.shapes import ModelShape

PARTS = (
    "params",
    "grads",
    "optimizer",
    "buffers",
    "fsdp_unsharded",
    "activations",
    "logits_loss",
    "moe_buffers",
    "comm_buffers",
    "fixed",
)
GiB = 1024**3


@dataclass(frozen=True)
class Breakdown:
    """Bytes per part at this rank's peak."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    buffers: int = 0
    fsdp_unsharded: int = 0
    activations: int = 0
    logits_loss: int = 0
    moe_buffers: int = 0
    comm_buffers: int = 0
    fixed: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class RankMemory:
    """One kind of rank: the pp rank and the stages it holds (every tp/ep/dp rank of it is alike)."""

    pp_rank: int
    stages: tuple[int, ...]
    breakdown: Breakdown

    pipelined: bool = False

    @property
    def kind(self) -> str:
        if not self.pipelined:
            return "every rank"
        many = len(self.stages) > 1
        return f"pp rank {self.pp_rank} (stage{'s' if many else ''} {', '.join(map(str, self.stages))})"

    @property
    def peak_bytes(self) -> int:
        return self.breakdown.total


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    layout: Layout
    instance: str | None
    ranks: tuple[RankMemory, ...]

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak_bytes

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB


# ---- the runtime's pipeline placement (hpkit.runtime.pipeline, restated torch-free) -------------------


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    if schedule == "zero_bubble":
        return [k * pp + (pp_rank if k % 2 == 0 else pp - 1 - pp_rank) for k in range(stages_per_rank)]
    return [k * pp + pp_rank for k in range(stages_per_rank)]


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def in_flight(layout: Layout, pp_rank: int) -> list[int]:
    """Microbatches whose activations each of this rank's stages holds at its peak (stage_ids order).

    GPipe runs every forward first; 1F1B's rank r runs pp - r forwards before its first backward; torch's
    interleaved 1F1B warms up (v-1) x pp + 2 (pp-1-r) chunks and runs one more forward before the first
    backward; ZBV (zero bubble) runs 2 (pp-r)-1 chunk-0 forwards, then r of each, then one chunk-1 forward."""
    pp, mb, v = layout.pp, layout.microbatches, layout.stages_per_rank
    if pp == 1:
        return [1]
    if layout.pp_schedule == "gpipe":
        return [mb]
    if layout.pp_schedule == "1f1b":
        return [min(mb, pp - pp_rank)]
    if layout.pp_schedule == "zero_bubble":
        return [min(mb, 2 * pp - pp_rank - 1), min(mb, pp_rank + 1)]
    # Interleaved: chunks go round the local stages in rounds of pp microbatches each.
    chunks = min((v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1, mb * v)
    counts = [0] * v
    for c in range(chunks):
        counts[(c // pp) % v] += 1
    return counts


# ---- parameters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """The weights one model part (a pipeline stage) holds on a rank, in elements, by how they are sharded."""

    dense: list[
        tuple[int, int]
    ]  # (first dim, other dims) of each weight after TP, FSDP-sharded over dense shards
    experts: list[tuple[int, int]]  # routed experts' weights after EP, FSDP-sharded over expert shards
    unsharded_units: list[int]  # each FSDP unit's elements after TP (what all-gather rebuilds)
    blocks: list[int]
    first: bool
    last: bool
    # LoRA: the adapters (the only trainable weights then), and which dense weights are nn.Linear's (the
    # ones autocast runs in bf16, so LoRA stores them in bf16 without FSDP).
    adapters: list[tuple[int, int]]
    linear: list[bool]


def _part(shape: ModelShape, layout: Layout, blocks: list[int], first: bool, last: bool) -> _Part:
    tp, ep = layout.tp, layout.ep
    h, hd, v = shape.dim, shape.hd, shape.vocab_size
    dense: list[tuple[int, int]] = []
    experts: list[tuple[int, int]] = []
    units: list[int] = []
    adapters: list[tuple[int, int]] = []
    linear: list[bool] = []
    if first:
        dense.append((v // tp, h))
        linear.append(False)
        units.append(v // tp * h)
    for i in blocks:
        unit = [
            (h, 1),  # attention_norm
            (h, 1),  # ffn_norm
            (shape.n_heads * hd // tp, h),  # wq
            (shape.n_kv_heads * hd // tp, h),  # wk
            (shape.n_kv_heads * hd // tp, h),  # wv
            (h, shape.n_heads * hd // tp),  # wo (row-parallel: the input dim is split; FSDP shards dim 0)
        ]
        if shape.is_moe_block(i):
            he = shape.expert_hidden
            unit.append((shape.experts or 0, h))  # router (replicated under TP)
            if shape.shared_experts:
                s = he * shape.shared_experts
                unit += [(s, h), (h, s), (s, h)]
            e_local = (shape.experts or 0) // ep
            experts += [(e_local, he * h)] * 3
        else:
            f = shape.ffn_dim // tp
            unit += [(f, h), (h, f), (f, h)]
        linear += [False, False] + [True] * (len(unit) - 2)
        dense += unit
        adapters += _adapters(shape, layout, i)
        units.append(
            sum(a * b for a, b in unit) + sum(a * b for a, b in experts[-3:] if shape.is_moe_block(i))
        )
    if last:
        dense += [(h, 1), (v // tp, h)]
        linear += [False, True]
        units.append(h + v // tp * h)
    return _Part(dense, experts, units, blocks, first, last, adapters, linear)


# LoRA targets (Hugging Face names) -> (input width, output width, column-parallel) of the projection.
def _adapters(shape: ModelShape, layout: Layout, index: int) -> list[tuple[int, int]]:
    """A (r x in) and B (out x r) of each adapted projection of block `index`, after TP: a column-parallel
    base shards B's rows, a row-parallel one A's columns (hpkit.runtime.lora)."""
    r, tp = shape.lora_rank, layout.tp
    if not r:
        return []
    h, q, kv = shape.dim, shape.n_heads * shape.hd, shape.n_kv_heads * shape.hd
    widths = {
        "q_proj": (h, q, True),
        "k_proj": (h, kv, True),
        "v_proj": (h, kv, True),
        "o_proj": (q, h, False),
        "gate_proj": (h, shape.ffn_dim, True),
        "up_proj": (h, shape.ffn_dim, True),
        "down_proj": (shape.ffn_dim, h, False),
    }
    out: list[tuple[int, int]] = []
    for target in shape.lora_targets:
        if shape.is_moe_block(index) and target in ("gate_proj", "up_proj", "down_proj"):
            continue  # the runtime refuses these on routed experts
        fan_in, fan_out, column = widths[target]
        out += [(r, fan_in), (fan_out // tp, r)] if column else [(r, fan_in // tp), (fan_out, r)]
    return out


def _sharded(weights: list[tuple[int, int]], shards: int) -> int:
    # FSDP2 shards dim 0, padding it to a multiple of the shard count.
    return sum(math.ceil(a / shards) * b for a, b in weights)


# ---- activations (bytes per token of one block) ----------------------------------------------------


def _regime(layout: Layout) -> str:
    """How the runtime runs the precision: fp32; bf16 by FSDP's param_dtype (everything bf16); or bf16 by
    autocast (no FSDP: the residual stream and norms stay fp32, each matmul input is cast)."""
    if layout.precision == "fp32":
        return "fp32"
    return "fsdp_bf16" if layout.fsdp_enabled else "autocast"


# Bytes per token one dense block saves for backward with no checkpointing, per unit of each width:
# h (model dim: block input, norm inputs/outputs and the matmul-input copies of them), q (query heads x
# head dim: rotated q, attention output), kv (rotated k, v), f (SwiGLU: w1, w3, silu, product), plus
# 4 per head (log-sum-exp) and 8 (the norms' rstd). Measured with saved-tensor hooks on
# hpkit.models.llama.Block (torch 2.13, CPU): fp32 and autocast exactly; fsdp_bf16 (which gloo cannot run)
# fitted to FSDPMemTracker under FakeTensor over three shapes (hpkit.plan.torch_check): the fp32 copies
# rotary embeddings make of k, and more of the norms' saves than halving fp32 gives.
_DENSE = {
    "fp32": {"h": 24, "q": 8, "kv": 8, "f": 16},
    "autocast": {"h": 26, "q": 4, "kv": 4, "f": 8},
    "fsdp_bf16": {"h": 15, "q": 4, "kv": 8, "f": 8},
}


def _block_saved(shape: ModelShape, layout: Layout, index: int, sp: bool) -> dict[str, float]:
    """Bytes per token one block keeps for backward: `none` (no checkpointing), `selective` (what the
    selective policy keeps: matmul and attention outputs, and the block input), `full` (the block input)."""
    regime = _regime(layout)
    c = _DENSE[regime]
    b = 4 if regime == "fp32" else 2  # matmul outputs
    stream = 2 if regime == "fsdp_bf16" else 4  # the residual stream between blocks
    tp = layout.tp
    h = shape.dim / (tp if sp else 1)
    q = shape.n_heads * shape.hd / tp
    kv = shape.n_kv_heads * shape.hd / tp
    heads = shape.n_heads / tp
    attn_none = c["h"] / 2 * h + c["q"] * q + c["kv"] * kv + 4 * heads + 4
    if tp > 1 and not sp:
        # The replicated norm output becomes a DTensor for the column-parallel matmuls: one more copy kept
        # (measured: fsdp_tp in tests/integration/plan_memory_layouts.py).
        attn_none += stream * h
    attn_sel = b * (2 * q + 2 * kv + h) + 4 * heads
    if shape.is_moe_block(index):
        ffn_none, ffn_sel = _moe_saved(shape, layout, b, h)
        ffn_none += c["h"] / 2 * h + 4
    else:
        f = shape.ffn_dim / tp
        ffn_none = c["h"] / 2 * h + c["f"] * f + 4
        ffn_sel = b * (2 * f + h)
    if shape.lora_rank:
        # A frozen base keeps no copy of its matmuls' inputs for weight gradients (measured: 8 bytes per
        # token per model-dim unit fewer, fp32 and autocast; fsdp_tp_lora, single_lora_bf16).
        attn_none -= 4 * h
        ffn_none -= 4 * h
    return {
        "none": attn_none + ffn_none,
        "selective": attn_sel + ffn_sel + stream * h,
        "full": stream * h,
    }


def _moe_saved(shape: ModelShape, layout: Layout, b: int, h: float) -> tuple[float, float]:
    """(none, selective) bytes per token of a MoE FFN (its norm excluded)."""
    k, e, he = shape.top_k or 0, shape.experts or 0, shape.expert_hidden
    dim = shape.dim  # the MoE FFN runs on whole (replicated) tokens under TP
    shared = shape.shared_experts or 0
    routed = k * (4 * b * he + 3 * b * dim)  # per routed slot: w1, w3, silu, product; rows, out, unsorted
    router = e * (b + 4 + 4 + 8)  # scores, fp32 probabilities, slots, one-hot (int64)
    none = routed + 4 * b * he * shared + router
    selective = 2 * b * he * (k + shared) + b * e + 2 * b * dim
    return none, selective


# ---- the model ------------------------------------------------------------------------------------


def predict(shape: ModelShape, layout: Layout, instance: str | None = None) -> MemoryPlan:
    """Each pp rank's peak memory under `layout` on `instance` (None: a CPU run, as the tests measure)."""
    ranks = tuple(_rank(shape, layout, r, instance) for r in range(layout.pp))
    return MemoryPlan(shape, layout, instance, ranks)


def _rank(shape: ModelShape, layout: Layout, pp_rank: int, instance: str | None) -> RankMemory:
    device = "cpu" if instance is None else "cuda"
    sp = layout.sequence_parallel_on(device)
    stages = stage_ids(pp_rank, layout.pp, layout.stages_per_rank, layout.pp_schedule)
    n_stages = layout.n_stages
    parts = [
        _part(shape, layout, stage_layers(shape.n_layers, n_stages, s), s == 0, s == n_stages - 1)
        for s in stages
    ]
    dense_shards, expert_shards = layout.fsdp_shards, layout.expert_fsdp_shards
    regime = _regime(layout)
    local = sum(_sharded(p.dense, dense_shards) + _sharded(p.experts, expert_shards) for p in parts)
    if shape.lora_rank:
        # The base is frozen: no gradient, no optimizer state; under bf16 it is stored in bf16 (all of it
        # with FSDP, the projections without). Only the adapters train.
        trainable = sum(_sharded(p.adapters, dense_shards) for p in parts)
        n_tensors = sum(len(p.adapters) for p in parts)
        base = 4 * local
        if layout.precision == "bf16":
            halved = sum(
                _sharded(
                    [w for w, lin in zip(p.dense, p.linear, strict=True) if lin or layout.fsdp_enabled],
                    dense_shards,
                )
                + _sharded(p.experts, expert_shards)
                for p in parts
            )
            base -= 2 * halved
        params = base + 4 * trainable
    else:
        trainable = local
        n_tensors = sum(len(p.dense) + len(p.experts) for p in parts)
        params = 4 * local
    optimizer = 8 * trainable + 4 * n_tensors
    grads = 4 * trainable
    buffers = len(parts) * 2 * shape.max_seq_len * (shape.hd // 2) * 4
    buffers += sum(4 * ((shape.experts or 0) + 2) for p in parts for i in p.blocks if shape.is_moe_block(i))

    pb = 2 if regime == "fsdp_bf16" else 4  # FSDP's unsharded weights (param_dtype)
    stream = 2 if regime == "fsdp_bf16" else 4
    # Compute copies of the weights, at the peak (the start of backward).
    unsharded = 0
    grads_at_peak = 0
    if layout.fsdp_enabled:
        if layout.pp > 1:
            # Nothing reshards under a pipeline, and the unsharded gradients accumulate over the microbatches
            # until the last one (in fp32: the reduce dtype).
            unsharded = sum(sum(p.unsharded_units) for p in parts) * pb
            grads_at_peak = 4 * (
                sum(a * b for p in parts for a, b in p.adapters)
                if shape.lora_rank
                else sum(sum(p.unsharded_units) for p in parts)
            )
        else:
            part = parts[0]
            blocks = part.unsharded_units[1:-1] if part.first else part.unsharded_units[:-1]
            # The head and the last block stay gathered from their forward into backward.
            unsharded = (part.unsharded_units[-1] + (blocks[-1] if blocks else 0)) * pb
    else:
        if regime == "autocast" and not shape.lora_rank:
            # autocast's cache keeps a bf16 copy of every weight a matmul used (not the embeddings); LoRA
            # stores those weights in bf16 already.
            unsharded = 2 * (local - sum(_sharded(p.dense[:1], 1) for p in parts if p.first))
        if layout.pp > 1:
            grads_at_peak = grads  # accumulated over the microbatches

    # Activations: saved per block and microbatch, times the microbatches in flight.
    tokens = layout.microbatch_size * shape.seq_len
    flights = in_flight(layout, pp_rank)
    ac = layout.activation_checkpoint
    saved_total = 0.0
    transient = 0.0
    for part, flight in zip(parts, flights, strict=True):
        for i in part.blocks:
            saved = _block_saved(shape, layout, i, sp)
            saved_total += saved[ac] * tokens * flight
            if ac != "none":
                # Backward recomputes one block's activations at a time.
                transient = max(transient, (saved["none"] - saved[ac]) * tokens)

    # Logits and loss on the rank with the last stage: the final norm's saves, the logits, the fp32
    # log-softmax, and backward's two fp32 gradients of them.
    logits_loss = 0
    last_at = [k for k, p in enumerate(parts) if p.last]
    if last_at:
        v = shape.vocab_size / (layout.tp if layout.loss_parallel else 1)
        b = 4 if regime == "fp32" else 2
        # (The loss's fp32 copy of bf16 logits is not kept: log-softmax's backward reads its output.)
        per_mb = tokens * (v * (b + 4) + 3 * stream * shape.dim)
        logits_loss = int(per_mb + tokens * v * 8)
        if layout.pp > 1:
            # torch's last stage keeps each microbatch's output for its loss and the gradient it returns,
            # beyond the one microbatch in loss (measured: the pipeline layouts, about 3 logits' worth).
            logits_loss += int(3 * tokens * v * b)
    activations = int(saved_total + (0 if ac == "none" else max(0.0, transient - logits_loss)))
    if ac != "none" and last_at:
        # The logits stay referenced while the last block is recomputed; the loss's temporaries do not.
        v = shape.vocab_size / (layout.tp if layout.loss_parallel else 1)
        activations += int(tokens * v * (4 if regime == "fp32" else 2))

    moe_buffers = 0
    if shape.is_moe and any(shape.is_moe_block(i) for p in parts for i in p.blocks) and layout.ep > 1:
        # Tokens exchanged with the experts' ranks: sent, received, regrouped, returned (each way).
        moe_buffers = int(4 * tokens * (shape.top_k or 0) * shape.dim * (4 if regime == "fp32" else 2))

    comm_buffers = 0
    if layout.pp > 1:
        # torch's stages allocate a receive buffer per microbatch for each direction they receive.
        h = shape.dim / (layout.tp if sp else 1)
        for p in parts:
            directions = (0 if p.first else 1) + (0 if p.last else 1)
            comm_buffers += int(directions * layout.microbatches * tokens * h * stream)

    costs = fixed_costs(instance)
    dynamic = activations + unsharded + logits_loss + moe_buffers
    fixed = costs.cuda_context_bytes + costs.nccl_buffer_bytes + int(costs.fragmentation * dynamic)
    # Two candidate peaks: the start of backward (every activation, no reduced gradient yet but what a
    # pipeline accumulates) and the optimizer step (every gradient, no activation).
    if dynamic + grads_at_peak < grads:
        activations = unsharded = logits_loss = moe_buffers = 0
        grads_at_peak = grads
    breakdown = Breakdown(
        params=params,
        grads=grads_at_peak,
        optimizer=optimizer,
        buffers=buffers,
        fsdp_unsharded=int(unsharded),
        activations=activations,
        logits_loss=logits_loss,
        moe_buffers=moe_buffers,
        comm_buffers=comm_buffers,
        fixed=fixed,
    )
    return RankMemory(pp_rank, tuple(stages), breakdown, pipelined=layout.pp > 1)
