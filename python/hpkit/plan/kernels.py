"""What a GPU runs that a CPU does not show, as the memory and speed models need it: which attention kernel SDPA
picks, which tensors each activation-checkpointing policy keeps, and how a training loop holds its logits.

Torch-free (the planner runs on login nodes). The rules restate torch's own (sdp_utils.cpp's kernel
constraints, in priority order flash, memory-efficient, math) and the runtime's
(hpkit.runtime.parallel.activation_checkpoint's save list, hpkit.runtime.loop.trainer's loss); tests/unit/test_plan_kernels.py
keeps the save lists equal to the runtime's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kernel = Literal["flash", "efficient", "math", "cpu_flash"]

# FlashAttention-2 in torch takes fp16/bf16 and head dims up to 256 (multiples of 8), causal or no mask, and
# grouped-query attention natively; the memory-efficient kernel takes fp32 too and any additive or boolean
# mask, but not enable_gqa (torch >= 2.5: sdp_utils.cpp check_grouped_query_attention only for flash and math).
FLASH_MAX_HEAD_DIM = 256
# GPUs older than sm80 (Ampere) have no flash kernel in torch: V100 (sm70) runs memory-efficient attention.
NO_FLASH_GPUS = ("V100",)


def sdpa_kernel(
    device: str, precision: str, head_dim: int, masked: bool = False, gqa: bool = False, gpu: str = ""
) -> Kernel:
    """The kernel F.scaled_dot_product_attention runs for the runtime's attention call on `device` (`gpu`: the
    catalog's GPU model, "" for a current one).

    flash and efficient keep the output and a float32 log-sum-exp per query and head for backward; math keeps
    the S x S probabilities. The CPU's flash kernel (the runtime's CPU ranks) keeps what flash keeps."""
    if device != "cuda":
        return "cpu_flash"
    half = precision == "bf16" and gpu not in NO_FLASH_GPUS
    if half and not masked and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0:
        return "flash"
    if not gqa:
        return "efficient"
    return "math"


# ---- activation checkpointing policies: the matmul outputs each keeps ----------------------------------------
#
# A dense block runs seven matmuls, in this order: wq, wk, wv (attention input), wo, then w1, w3, w2 (SwiGLU:
# w2(silu(w1(x)) * w3(x))). A selective policy keeps the outputs of some of them and of the attention kernel;
# everything else is recomputed in backward. The block input is kept by every checkpointing mode.
MATMULS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


@dataclass(frozen=True)
class SelectivePolicy:
    name: str
    kept_matmuls: tuple[str, ...]  # whose outputs are saved (the others are recomputed in backward)
    keeps_attention: bool  # the flash/efficient kernel's output and log-sum-exp


# hpkit.runtime.parallel.activation_checkpoint._SAVE_OPS: every mm/addmm/bmm and the attention kernels.
HPKIT_SELECTIVE = SelectivePolicy("hpkit", MATMULS, True)
# torchtitan's "op" selective AC (torchtitan/parallelisms/parallelize_llama.py at 9dec370, _save_list): every
# saved op except every second mm, counted per block: mm 1, 3, 5, 7 (wq, wv, w1, w2) are kept.
TORCHTITAN_OP_SELECTIVE = SelectivePolicy("torchtitan-op", ("wq", "wv", "w1", "w2"), True)
POLICIES = {p.name: p for p in (HPKIT_SELECTIVE, TORCHTITAN_OP_SELECTIVE)}


@dataclass(frozen=True)
class TrainingLoop:
    """How a training loop holds what the memory model cannot read from the layout.

    keeps_logits: the loop's variable still references the logits while backward runs (hpkit's trainer and
    bench/gpu_mfu.py; torchtitan's train.py `del pred`s them first). embeddings_kept: FSDP keeps the
    embeddings gathered from forward to backward (torchtitan leaves them to the root, which never reshards
    after forward; hpkit makes them a unit that does, hpkit.runtime.parallel.fsdp)."""

    selective: SelectivePolicy = HPKIT_SELECTIVE
    keeps_logits: bool = True
    embeddings_kept: bool = False
    # nn.RMSNorm runs torch's fused rms_norm kernel on CUDA; torchtitan's 2024 RMSNorm was Python over fp32.
    fused_norm: bool = True
    # GQA: the loop repeats k and v to every head before attention (torchtitan's repeat_kv), or hands SDPA
    # enable_gqa (hpkit).
    repeats_kv: bool = False


HPKIT = TrainingLoop()
TORCHTITAN = TrainingLoop(
    TORCHTITAN_OP_SELECTIVE, keeps_logits=False, embeddings_kept=True, fused_norm=False, repeats_kv=True
)
LOOPS = {"hpkit": HPKIT, "torchtitan": TORCHTITAN}
