"""`hpkit plan --explain`: each term of a layout's peak memory and step time, with the inputs of its formula, read
from the models themselves (hpkit.plan.memory, hpkit.plan.speed), so that a user can see why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpkit.plan import memory, speed
from hpkit.plan.kernels import HPKIT, TrainingLoop, sdpa_kernel

if TYPE_CHECKING:
    from hpkit.models.llama.shape import ModelShape
    from hpkit.plan.search import Candidate

GiB = 1024**3


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def memory_lines(
    shape: ModelShape, cand: Candidate, instance: str | None, loop: TrainingLoop = HPKIT
) -> list[str]:
    plan = cand.memory
    worst = plan.worst
    layout = cand.layout
    r = memory._read_rank(shape, layout, worst.pp_rank, instance, loop)
    bd = worst.breakdown
    tokens, ac = r.tokens, layout.activation_checkpoint
    blocks = [i for p in r.parts for i in p.blocks]
    saved = memory._saved(r, blocks[0]) if blocks else {"none": 0.0, ac: 0.0}
    kernel = sdpa_kernel(r.device, layout.precision, shape.hd, gqa=shape.n_kv_heads != shape.n_heads)
    flights = memory.in_flight(layout, worst.pp_rank)
    lines = [
        f"memory at the peak ({worst.kind}), {r.device}, {r.regime} ({layout.precision}), loop {loop.selective.name}:"
    ]
    lines.append(
        f"  params {_gib(bd.params)}: 4 bytes x local elements (fp32 master weights; FSDP shards "
        f"{layout.fsdp_shards}, tp {layout.tp}, ep {layout.ep})"
    )
    lines.append(
        f"  optimizer {_gib(bd.optimizer)}: AdamW's two fp32 moments, 8 bytes x trainable local elements, + step"
    )
    lines.append(
        f"  grads {_gib(bd.grads)}: held at the peak (0 at the start of backward after zero_grad; the optimizer step's peak holds all)"
    )
    lines.append(
        f"  buffers {_gib(bd.buffers)}: rotary tables, 2 x max_seq {shape.max_seq_len} x head_dim/2 x 4 bytes"
    )
    lines.append(
        f"  fsdp_unsharded {_gib(bd.fsdp_unsharded)}: FSDP's gathered units at the peak (the head, the last block"
        f"{', the embeddings' if loop.embeddings_kept else ''}; all under pp) in param_dtype"
    )
    lines.append(
        f"  autocast_copies {_gib(bd.autocast_copies)}: without FSDP under bf16, the bf16 weight copies the matmuls save"
    )
    lines.append(
        f"  activations {_gib(bd.activations)}: {saved[ac]:,.0f} bytes per token per block (ac {ac}; none would keep "
        f"{saved['none']:,.0f}) x {tokens:,} tokens x {len(blocks)} blocks x microbatches in flight {flights}; "
        f"attention kernel {kernel}"
    )
    lines.append(
        f"  logits_loss {_gib(bd.logits_loss)}: {tokens:,} tokens x vocab {r.vocab:,.0f} x bytes per logit (logits, "
        f"fp32 upcast, log-softmax, backward's two fp32 gradients{'; logits kept through backward' if loop.keeps_logits else ''})"
    )
    if bd.moe_buffers:
        lines.append(
            f"  moe_buffers {_gib(bd.moe_buffers)}: the experts' all-to-all copies, 4 x tokens x top_k x dim"
        )
    if bd.comm_buffers:
        lines.append(
            f"  comm_buffers {_gib(bd.comm_buffers)}: a pipeline stage's receive buffers per microbatch"
        )
    lines.append(
        f"  reserve {_gib(bd.reserve)}: the caching allocator's cached blocks (FSDP's side-stream pools: the largest "
        "unit's all-gather buffer and the sharded gradients; a freed logits block too small for the loss's gradients)"
    )
    lines.append(
        f"  fixed {_gib(bd.fixed)}: CUDA context and NCCL buffers (hpkit.plan.fixed_costs), outside the allocator"
    )
    lines.append(
        f"  = {_gib(bd.total)} (torch would report max_memory_allocated {_gib(bd.allocated)}, "
        f"max_memory_reserved {_gib(bd.reserved)})"
    )
    return lines


def speed_lines(
    shape: ModelShape, cand: Candidate, hw: speed.Hardware, loop: TrainingLoop = HPKIT
) -> list[str]:
    plan = cand.speed
    layout = cand.layout
    st = speed._Step(shape, layout, hw, shape.seq_len, loop)
    kernel = sdpa_kernel(
        "cuda" if hw.gpu else "cpu", layout.precision, shape.hd, gqa=shape.n_kv_heads != shape.n_heads
    )
    lines = [
        f"step time {plan.step_s * 1000:.1f} ms on {hw.name} (peak {hw.peak_flops / 1e12:.0f} TFLOP/s, HBM {hw.mem_bw / 1e9:.0f} GB/s):"
    ]
    dense = [b for b in range(shape.n_layers) if not shape.is_moe_block(b)]
    block = dense[0] if dense else 0
    mm = speed._matmuls(st, block)
    flops = sum(2 * st.tokens_mb * k * n * 3 for k, n in mm.values())
    lines.append(
        f"  compute {plan.parts.get('compute', 0) * 1000:.1f} ms: per block {flops / 1e12:.2f} TFLOP of matmuls at "
        f"{speed.MATMUL_EFFICIENCY:.0%} of peak; attention ({kernel}) {speed._attention_s(st) * 1000:.2f} ms"
        + (
            f" at {speed.ATTENTION_EFFICIENCY[kernel]:.0%} of peak on the causal half; elementwise "
            f"{speed._elementwise_bytes(st, block):,.0f} bytes per token forward (x3 with backward) at "
            f"{speed.HBM_EFFICIENCY:.0%} of HBM"
            if hw.gpu
            else ""
        )
        + f"; {st.tokens_mb:,.0f} tokens per microbatch x {st.mbs} microbatches; ac {layout.activation_checkpoint}"
        + (
            f" (recomputes what {loop.selective.name}'s policy does not keep)"
            if layout.activation_checkpoint == "selective"
            else ""
        )
        + f"; head and loss {speed._head_s(st) * 1000:.1f} ms"
    )
    for part, why in (
        ("bubble", "the pipeline's idle share"),
        ("tp", "tensor parallel's all-reduces, exposed"),
        ("ep", "the experts' all-to-alls, exposed"),
        ("pp", "the stages' sends"),
        ("fsdp", "FSDP's gathers and reduce-scatters beyond what compute hides, and its copy-in/out"),
        ("ddp", "DDP's all-reduce beyond what backward hides"),
        ("optimizer", "AdamW's bytes over the local shard at HBM speed (and autocast's casts)"),
    ):
        if plan.parts.get(part):
            lines.append(f"  {part} {plan.parts[part] * 1000:.1f} ms: {why}")
    lines.append(
        f"  = {plan.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {plan.mfu:.1%} "
        f"({shape.flops_per_token(shape.seq_len) / 1e9:.1f} GFLOP a token)"
    )
    return lines


def explain_text(shape: ModelShape, cand: Candidate, hw: speed.Hardware, instance: str | None) -> str:
    lines = ["", f"why {cand.layout.describe()}:"]
    if cand.memory is not None:
        lines += memory_lines(shape, cand, instance)
    if cand.speed is not None:
        lines += speed_lines(shape, cand, hw)
    return "\n".join(lines)
