"""Peak memory per rank of a layout, from the parts that make it, as the runtime (hpkit.runtime) allocates them.

Every rank of a pipeline rank's row holds the same tensors (tp, ep and dp shards are equal up to FSDP's
padding, which is counted), so the plan has one entry per pp rank. The parts:

- params, grads, optimizer: fp32 master weights in every precision (FSDP2's MixedPrecisionPolicy casts a
  copy to bf16 for compute and reduces gradients in fp32; without FSDP, autocast casts per op), so 4 bytes
  per local element each, AdamW's two moments 8 more. Local elements: TP shards attention, dense FFNs,
  embeddings and head; EP splits routed experts; FSDP shards what is left over dp_shard x ep (dense) or
  dp_shard (experts), padding each weight's first dimension to the shard count.
- fsdp_unsharded: FSDP's compute copies of the weights. FSDP2 all-gathers a unit (a block; the embeddings; the
  head) before its forward and reshards it after, except the last block and the head, and prefetches the next
  unit in backward; under a pipeline nothing reshards (every microbatch would all-gather again) and the
  unsharded gradients accumulate in fp32 until the last microbatch. Zero without FSDP.
- autocast_copies: without FSDP under bf16, the bf16 copy of each weight autocast casts, which its matmul
  saves for backward.
- activations: what each block saves for backward, per token, under none/selective/full checkpointing (each
  selective policy its own matmul outputs: hpkit.plan.kernels), times the blocks on the stage and the
  microbatches its pipeline schedule keeps in flight; plus the transient of the block being recomputed
  (checkpointing) or run. On GPUs tensor by tensor from the kernels CUDA runs (_gpu_block_saved: flash or
  memory-efficient attention keeps no S x S probabilities); on CPU ranks as measured.
- logits_loss: the output head's logits, the loss's fp32 upcast and log-softmax, and their gradients, on the
  rank with the last stage.
- moe_buffers: routing (router scores, one-hot slots) and the token copies the experts' dispatch makes.
- comm_buffers: a pipeline stage's receive buffers (one per microbatch, each direction).
- buffers: the rotary tables (every part holds them) and MoE counters.
- reserve: what the CUDA caching allocator holds reserved beyond the tensors at the peak: the blocks cached
  in FSDP's side streams' pools, and a freed block too small for the loss's backward (GPUs only).
- fixed: the CUDA context and NCCL's buffers (hpkit.plan.fixed_costs), outside the allocator; zero on CPUs.

`Breakdown.allocated` is what torch.cuda.max_memory_allocated reports, `reserved` max_memory_reserved (what
torchtitan logs), `total` what the GPU must hold. tests/unit/test_plan_published.py checks them against
published GPU runs (tests/fixtures/published_gpu_runs.json).

The activation coefficients below were measured with torch's MemTracker on this runtime's blocks (CPU);
tests/integration/test_plan_memory_measured.py keeps them honest for every layout the runtime trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from hpkit import catalog
from hpkit.layout_rules.pipeline import stage_ids, stage_layers
from hpkit.models.llama.shape import ModelShape
from hpkit.plan.fixed_costs import fixed_costs
from hpkit.plan.kernels import HPKIT, TrainingLoop, sdpa_kernel
from hpkit.plan.layout import Layout

PARTS = (
    "params",
    "grads",
    "optimizer",
    "buffers",
    "fsdp_unsharded",
    "autocast_copies",
    "activations",
    "logits_loss",
    "moe_buffers",
    "comm_buffers",
    "reserve",
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
    autocast_copies: int = 0
    activations: int = 0
    logits_loss: int = 0
    moe_buffers: int = 0
    comm_buffers: int = 0
    reserve: int = 0
    fixed: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def allocated(self) -> int:
        """What torch.cuda.max_memory_allocated reports: the tensors alone."""
        return self.total - self.reserve - self.fixed

    @property
    def reserved(self) -> int:
        """What torch.cuda.max_memory_reserved reports: the tensors and the caching allocator's cached blocks."""
        return self.total - self.fixed

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


# ---- pipeline ---------------------------------------------------------------------------------------


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
    base shards B's rows, a row-parallel one A's columns (hpkit.runtime.loop.lora)."""
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


def _widths(shape: ModelShape, tp: int, sp: bool) -> tuple[float, float, float]:
    """Per token on one rank under TP: (the residual stream, sequence-sharded under SP; the query heads; the key
    or the value heads)."""
    return shape.dim / (tp if sp else 1), shape.n_heads * shape.hd / tp, shape.n_kv_heads * shape.hd / tp


def _block_saved(shape: ModelShape, layout: Layout, index: int, sp: bool) -> dict[str, float]:
    """Bytes per token one block keeps for backward: `none` (no checkpointing), `selective` (what the
    selective policy keeps: matmul and attention outputs, and the block input), `full` (the block input)."""
    regime = _regime(layout)
    c = _DENSE[regime]
    b = 4 if regime == "fp32" else 2  # matmul outputs
    stream = 2 if regime == "fsdp_bf16" else 4  # the residual stream between blocks
    tp = layout.tp
    h, q, kv = _widths(shape, tp, sp)
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


# ---- activations on a GPU (bytes per token of one block) -----------------------------------------------


def _gpu_block_saved(
    shape: ModelShape, layout: Layout, index: int, sp: bool, loop: TrainingLoop, gpu: str = ""
) -> dict[str, float]:
    """What one block keeps for backward on a GPU, tensor by tensor, from the kernels CUDA runs.

    none: the block input and the FFN's input (the residual stream), each norm's rstd (fp32 per token) and the
    norm output its matmuls save as input (one bf16 tensor under FSDP; under autocast one cast per matmul, since
    autocast caches only weights' casts); rotary's output q, k and v, which the attention kernel saves with its
    output and log-sum-exp (flash/efficient) or its S x S probabilities (math); SwiGLU's w1 and w3 outputs, silu's
    and the product. Rotary's fp32 copies are not saved (its complex multiply keeps only the table), and the
    attention output is wo's input without a copy (flash writes it in (batch, seq, heads) order).
    selective: the policy's matmul outputs and the attention kernel's outputs, and the block input.
    full: the block input."""
    regime = _regime(layout)
    b = 4 if regime == "fp32" else 2  # activations out of matmuls
    stream = 2 if regime == "fsdp_bf16" else 4  # the residual stream between blocks
    tp = layout.tp
    h, q, kv = _widths(shape, tp, sp)
    heads = shape.n_heads / tp
    gqa = shape.n_kv_heads != shape.n_heads
    kernel = sdpa_kernel("cuda", layout.precision, shape.hd, gqa=gqa, gpu=gpu)
    # The norm output each half's matmuls save: autocast casts it once per matmul (3 attention, 2 SwiGLU).
    casts = (3, 2) if regime == "autocast" else (1, 1)
    norm_b = 2 if regime == "autocast" else b
    if kernel == "math":
        # The probabilities (and, with GQA, k and v repeated to every head) and a contiguous copy of the output.
        attention_kept = b * heads * shape.seq_len + b * q + (2 * b * q if kv != q else 0)
        attention_out = b * heads * shape.seq_len + b * q  # the policies keep the two bmm outputs
    else:
        attention_kept = b * q + 4 * heads
        attention_out = attention_kept
    attn_none = stream * h + 4 + casts[0] * norm_b * h + b * (q + 2 * kv) + attention_kept
    if tp > 1 and not sp:
        attn_none += stream * h  # the replicated norm output's DTensor copy (as measured on CPU ranks)
    widths = {"wq": q, "wk": kv, "wv": kv, "wo": h, "w1": 0.0, "w3": 0.0, "w2": h}
    if shape.is_moe_block(index):
        ffn_none, ffn_sel = _moe_saved(shape, layout, b, h)
        ffn_none += stream * h + 4 + casts[1] * norm_b * h
    else:
        f = shape.ffn_dim / tp
        widths |= {"w1": f, "w3": f}
        ffn_none = stream * h + 4 + casts[1] * norm_b * h + 4 * b * f
        ffn_sel = 0.0
    policy = loop.selective
    kept = sum(
        b * widths[m]
        for m in policy.kept_matmuls
        if not (shape.is_moe_block(index) and m in ("w1", "w3", "w2"))
    )
    selective = kept + (attention_out if policy.keeps_attention else 0.0) + ffn_sel + stream * h
    return {"none": attn_none + ffn_none, "selective": selective, "full": stream * h}


# ---- the model ------------------------------------------------------------------------------------


def predict(
    shape: ModelShape, layout: Layout, instance: str | None = None, loop: TrainingLoop = HPKIT
) -> MemoryPlan:
    """Each pp rank's peak memory under `layout` on `instance` (None: a CPU run, as the tests measure), run by
    `loop` (default hpkit's runtime; TORCHTITAN for torchtitan's published runs)."""
    ranks = tuple(_rank(shape, layout, r, instance, loop) for r in range(layout.pp))
    return MemoryPlan(shape, layout, instance, ranks)


@dataclass(frozen=True)
class _Rank:
    """What one pp rank holds, read once from the layout."""

    shape: ModelShape
    layout: Layout
    device: str
    sp: bool
    pp_rank: int
    stages: list[int]
    parts: list[_Part]
    regime: str
    loop: TrainingLoop
    gpu: str = ""  # the catalog's GPU model ("" on CPU ranks, or a type the catalog lacks)

    @property
    def tokens(self) -> int:
        return self.layout.microbatch_size * self.shape.seq_len

    @property
    def has_last_stage(self) -> bool:
        return any(p.last for p in self.parts)

    @property
    def vocab(self) -> float:
        return self.shape.vocab_size / (self.layout.tp if self.layout.loss_parallel else 1)

    @property
    def stream(self) -> int:
        return 2 if self.regime == "fsdp_bf16" else 4


def _rank(
    shape: ModelShape, layout: Layout, pp_rank: int, instance: str | None, loop: TrainingLoop = HPKIT
) -> RankMemory:
    r = _read_rank(shape, layout, pp_rank, instance, loop)
    params, grads, optimizer = _weights(r)
    buffers = _buffers(r)
    unsharded, autocast, grads_at_peak = _compute_copies(r, grads)
    logits_loss, loss_reserve = _logits_loss(r)
    activations = _activations(r, logits_loss) + _weight_grad_stash(r)
    moe_buffers = _moe_buffers(r)
    comm_buffers = _comm_buffers(r)
    # Two candidate peaks: the start of backward (every activation, no reduced gradient yet but what a
    # pipeline accumulates) and the optimizer step (every gradient, no activation).
    # FSDP's sharded gradients sit in the reduce-scatter stream's pool (`_reserve`): at the optimizer step they are
    # the gradients themselves, counted once.
    sharded_grads_pool = grads
    if activations + unsharded + autocast + logits_loss + moe_buffers + grads_at_peak < grads:
        activations = unsharded = autocast = logits_loss = moe_buffers = loss_reserve = 0
        grads_at_peak = grads
        sharded_grads_pool = 0
    costs = fixed_costs(instance)
    breakdown = Breakdown(
        params=params,
        grads=grads_at_peak,
        optimizer=optimizer,
        buffers=buffers,
        fsdp_unsharded=int(unsharded),
        autocast_copies=int(autocast),
        activations=activations,
        logits_loss=logits_loss,
        moe_buffers=moe_buffers,
        comm_buffers=comm_buffers,
        reserve=_reserve(r, sharded_grads_pool) + loss_reserve if r.device == "cuda" else 0,
        fixed=costs.cuda_context_bytes + costs.nccl_buffer_bytes,
    )
    return RankMemory(pp_rank, tuple(r.stages), breakdown, pipelined=layout.pp > 1)


def _read_rank(
    shape: ModelShape, layout: Layout, pp_rank: int, instance: str | None, loop: TrainingLoop
) -> _Rank:
    device = "cpu" if instance is None else "cuda"
    stages = stage_ids(pp_rank, layout.pp, layout.stages_per_rank, layout.pp_schedule)
    n_stages = layout.n_stages
    parts = [
        _part(shape, layout, stage_layers(shape.n_layers, n_stages, s), s == 0, s == n_stages - 1)
        for s in stages
    ]
    sp = layout.sequence_parallel_on(device)
    row = catalog.lookup(instance)
    gpu = row.gpu if row is not None else ""
    return _Rank(shape, layout, device, sp, pp_rank, stages, parts, _regime(layout), loop, gpu)


def _weights(r: _Rank) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes: fp32 master weights, fp32 gradients, AdamW's two moments and step."""
    shape, layout, parts = r.shape, r.layout, r.parts
    dense_shards, expert_shards = layout.fsdp_shards, layout.expert_fsdp_shards
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
    return params, 4 * trainable, 8 * trainable + 4 * n_tensors


def _buffers(r: _Rank) -> int:
    """The rotary tables (every part holds them) and MoE counters."""
    shape = r.shape
    buffers = len(r.parts) * 2 * shape.max_seq_len * (shape.hd // 2) * 4
    return buffers + sum(
        4 * ((shape.experts or 0) + 2) for p in r.parts for i in p.blocks if shape.is_moe_block(i)
    )


def _compute_copies(r: _Rank, grads: int) -> tuple[int, int, int]:
    """(FSDP's unsharded weights, autocast's bf16 weight copies, gradients held) at the start of backward."""
    shape, layout, parts = r.shape, r.layout, r.parts
    pb = 2 if r.regime == "fsdp_bf16" else 4  # FSDP's unsharded weights (param_dtype)
    unsharded = autocast = grads_at_peak = 0
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
            # The head and the last block stay gathered from their forward into backward, and the
            # embeddings too where the loop leaves them to the root (which never reshards after forward).
            unsharded = (part.unsharded_units[-1] + (blocks[-1] if blocks else 0)) * pb
            if r.loop.embeddings_kept and part.first:
                unsharded += part.unsharded_units[0] * pb
    else:
        if r.regime == "autocast" and not shape.lora_rank:
            # Each matmul saves autocast's bf16 copy of its weight for backward (not the embeddings'); LoRA
            # stores those weights in bf16 already. No FSDP here: these are not FSDP's.
            local = sum(_sharded(p.dense, 1) + _sharded(p.experts, 1) for p in parts)
            autocast = 2 * (local - sum(_sharded(p.dense[:1], 1) for p in parts if p.first))
        if layout.pp > 1:
            grads_at_peak = grads  # accumulated over the microbatches
    return unsharded, autocast, grads_at_peak


def _saved(r: _Rank, index: int) -> dict[str, float]:
    if r.device == "cuda":
        return _gpu_block_saved(r.shape, r.layout, index, r.sp, r.loop, r.gpu)
    return _block_saved(r.shape, r.layout, index, r.sp)


def _activations(r: _Rank, logits_loss: int) -> int:
    """Saved per block and microbatch, times the microbatches in flight, and the transient of the block that
    backward recomputes (checkpointing) beyond what the loss frees before it."""
    tokens = r.tokens
    flights = in_flight(r.layout, r.pp_rank)
    ac = r.layout.activation_checkpoint
    saved_total = 0.0
    transient = 0.0
    for part, flight in zip(r.parts, flights, strict=True):
        for i in part.blocks:
            saved = _saved(r, i)
            saved_total += saved[ac] * tokens * flight
            if ac != "none":
                # Backward recomputes one block's activations at a time.
                transient = max(transient, (saved["none"] - saved[ac]) * tokens)
    activations = int(saved_total + (0 if ac == "none" else max(0.0, transient - logits_loss)))
    if ac != "none" and r.has_last_stage and r.loop.keeps_logits:
        # The logits stay referenced while the last block is recomputed; the loss's temporaries do not.
        activations += int(tokens * r.vocab * (4 if r.regime == "fp32" else 2))
    return activations


def _weight_grad_stash(r: _Rank) -> int:
    """Zero bubble's deferred weight gradients: a stage's backward for its input runs first, and the gradients of
    its matmuls' outputs stay until the weight-gradient pass of that microbatch runs later (their inputs are kept
    anyway, as activations). At the peak each stage holds one microbatch's (measured: pp_tp_zero_bubble in
    tests/integration/plan_memory_layouts.py, 9 % under without this). CPU ranks only: no GPU run with this
    schedule has been measured or published to check it against, and on GPUs it would move the shipped recipes'
    layouts (llama3-70b-p5en-16n: 13.3 GiB more on its first rank, which then no longer fits) on one tiny CPU
    model's evidence."""
    layout, shape = r.layout, r.shape
    if layout.pp <= 1 or layout.pp_schedule != "zero_bubble" or r.device == "cuda":
        return 0
    b = 4 if r.regime == "fp32" else 2
    tp = layout.tp
    h, q, kv = _widths(shape, tp, r.sp)  # h: a row-parallel matmul's output
    per_token = 0.0
    for part in r.parts:
        for i in part.blocks:
            if shape.is_moe_block(i):
                he, k = shape.expert_hidden, (shape.top_k or 0) + (shape.shared_experts or 0)
                ffn = k * (2 * he + shape.dim)  # each slot's w1, w3 and w2 outputs
            else:
                ffn = 2 * shape.ffn_dim / tp + h
            per_token += q + 2 * kv + h + ffn
        if part.last:
            per_token += shape.vocab_size / tp  # the output head's
    return int(per_token * b * r.tokens)


def _logits_loss(r: _Rank) -> tuple[int, int]:
    """(bytes, the allocator's extra reserve) of the output head's logits and the loss, on the last stage.

    On a GPU, tensor by tensor: the logits (bf16 under mixed precision), the loss's fp32 upcast (freed after
    log-softmax), log-softmax's fp32 output (kept for backward), and backward's two fp32 gradients of it (nll's
    and log-softmax's) beside it; the logits too while the loop still references them. CPU ranks: as measured
    (the loss's fp32 copy of bf16 logits is not kept: log-softmax's backward reads its output)."""
    if not r.has_last_stage:
        return 0, 0
    tokens, v, stream = r.tokens, r.vocab, r.stream
    norm_saves = tokens * 3 * stream * r.shape.dim  # the final norm's
    b = 4 if r.regime == "fp32" else 2
    if r.device != "cuda":
        logits_loss = int(tokens * (v * (b + 4) + 3 * stream * r.shape.dim) + tokens * v * 8)
        reserve = 0
    else:
        upcast = 4 if b == 2 else 0
        forward = b + upcast + 4
        backward = 12 + (b if r.loop.keeps_logits else 0)
        logits_loss = int(norm_saves + tokens * v * max(forward, backward))
        reserve = int(tokens * v * _loss_reserve(b, r.loop.keeps_logits))
    if r.layout.pp > 1:
        # torch's last stage keeps each microbatch's output for its loss and the gradient it returns,
        # beyond the one microbatch in loss (measured: the pipeline layouts, about 3 logits' worth).
        logits_loss += int(3 * tokens * v * b)
    return logits_loss, reserve


def _loss_reserve(logit_bytes: int, keeps_logits: bool) -> float:
    """Bytes per logit the caching allocator holds reserved but unallocated at the loss's backward peak.

    The allocator never returns a segment within a step and serves a request from the smallest cached free
    block that holds it, splitting it, else from a new segment. Forward allocates the logits, the fp32 upcast
    and log-softmax's output; the upcast (and the logits, when the loop drops them) are then freed; backward
    asks for nll's gradient and log-softmax's (4 bytes each). A freed block too small for a 4-byte request
    stays reserved and unused: the bf16 logits a loop drops (torchtitan's `del pred`)."""
    free: list[float] = []
    if logit_bytes == 2:
        free.append(4.0)  # the upcast
    if not keeps_logits:
        free.append(float(logit_bytes))
    for _ in range(2):  # nll's gradient, log-softmax's gradient
        fits = sorted(f for f in free if f >= 4)
        if fits:
            free.remove(fits[0])
            if fits[0] > 4:
                free.append(fits[0] - 4)
    return sum(free)


def _reserve(r: _Rank, grads: int) -> int:
    """The caching allocator's memory reserved by FSDP's side streams: a block cached in one stream's pool serves
    only that stream. The all-gather output lives on the copy-in stream (the largest unit's unsharded weights in
    param_dtype, prefetches split from it); the reduce-scatter output on the reduce-scatter stream, and it becomes
    the sharded gradient (fp32, as the reduce dtype is the parameters'), so that pool holds every sharded gradient
    of the step and keeps it reserved after zero_grad frees them."""
    layout = r.layout
    if not layout.fsdp_enabled or layout.fsdp_shards <= 1:
        return 0
    pb = 2 if r.regime == "fsdp_bf16" else 4
    units = [u for p in r.parts for u in p.unsharded_units]
    if r.loop.embeddings_kept and r.parts[0].first and r.parts[-1].last and len(units) > 1:
        units = [units[0] + units[-1], *units[1:-1]]  # the root: embeddings, final norm and head together
    return int(max(units, default=0) * pb + grads)


def _moe_buffers(r: _Rank) -> int:
    """Tokens exchanged with the experts' ranks: sent, received, regrouped, returned (each way)."""
    shape = r.shape
    if not (
        shape.is_moe and r.layout.ep > 1 and any(shape.is_moe_block(i) for p in r.parts for i in p.blocks)
    ):
        return 0
    return int(4 * r.tokens * (shape.top_k or 0) * shape.dim * (4 if r.regime == "fp32" else 2))


def _comm_buffers(r: _Rank) -> int:
    """torch's stages allocate a receive buffer per microbatch for each direction they receive."""
    layout = r.layout
    if layout.pp <= 1:
        return 0
    h = r.shape.dim / (layout.tp if r.sp else 1)
    total = 0
    for p in r.parts:
        directions = (0 if p.first else 1) + (0 if p.last else 1)
        total += int(directions * layout.microbatches * r.tokens * h * r.stream)
    return total
