"""A Llama-style decoder's shape as plain numbers: its parameter and FLOP counts, the rules a shape must meet,
and a named shape with a spec's overrides.

The one home of these numbers: the runtime's LlamaConfig (hpkit.models.llama.model) counts and checks through
ModelShape, and the planner (hpkit.plan) plans with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpkit.errors import SpecError
from hpkit.models.llama.named import DEFAULT_MAX_SEQ_LEN, SHAPE_TABLE

# The MoE fields a model.moe block leaves unset on a dense shape (hpkit.models.llama.moe.MoEConfig's defaults).
MOE_DEFAULTS: dict[str, Any] = {
    "experts": 8,
    "top_k": 2,
    "shared_experts": 0,
    "every": 1,
    "aux_loss_coef": 0.01,
    "expert_ffn_dim": None,
}


# The largest value a shape's counts may take: far past any published model (Llama 3 405B: 126 blocks, dim 16,384,
# vocab 128,256), and small enough that the counts, which walk the blocks one by one, answer at once (a config.json
# with 10^20 layers ended in an OverflowError traceback; 10^12 would have run for hours).
MAX_LAYERS = 10_000
MAX_WIDTH = 2**24  # every other count: dim, heads, ffn_dim, vocab_size, head_dim, experts, top_k
_COUNTS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "head_dim",
    "experts",
    "top_k",
    "shared_experts",
    "expert_ffn_dim",
)


def count_limit(field: str) -> int:
    """The most a shape count may be (MAX_LAYERS for n_layers, else MAX_WIDTH)."""
    return MAX_LAYERS if field == "n_layers" else MAX_WIDTH


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Hugging Face's rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder (RMSNorm, GQA attention, SwiGLU, untied embeddings), optionally with MoE blocks.

    The moe fields are None for a dense model; with experts set, every `every`-th block's FFN is `experts`
    routed experts of `expert_ffn_dim` (None: ffn_dim) hidden units, `top_k` per token, plus
    `shared_experts` always-on ones.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    head_dim: int | None = None  # None: dim // n_heads
    experts: int | None = None
    top_k: int | None = None
    shared_experts: int | None = None
    every: int | None = None
    expert_ffn_dim: int | None = None
    aux_loss_coef: float | None = None  # the load-balancing loss's weight: training only, no count uses it
    name: str = "custom"
    # LoRA (model.lora): the base is frozen and these projections (Hugging Face names) gain rank-r adapters.
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()

    # ---- structure ----------------------------------------------------------------------------------

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    @property
    def max_seq_len(self) -> int:
        """The length the rotary tables cover (LlamaConfig.max_seq_len as config_for sets it)."""
        return max(self.seq_len, DEFAULT_MAX_SEQ_LEN)

    def is_moe_block(self, index: int) -> bool:
        return self.is_moe and (index + 1) % (self.every or 1) == 0

    def tp_dims(self) -> dict[str, int]:
        """The dimensions tensor parallel splits (hpkit.layout_rules.parallel.tp_problem's keywords)."""
        return {
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "ffn_dim": self.ffn_dim,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
        }

    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_block(i)]

    @property
    def expert_hidden(self) -> int:
        return self.expert_ffn_dim or self.ffn_dim

    # ---- parameter counts (elements) ----------------------------------------------------------------

    def attention_params(self) -> int:
        return self.dim * self.hd * (self.n_heads * 2 + self.n_kv_heads * 2)

    def dense_ffn_params(self) -> int:
        return 3 * self.dim * self.ffn_dim

    def routed_expert_params(self) -> int:
        """One MoE block's routed experts, all E of them (the part expert parallel splits)."""
        return 3 * self.dim * self.expert_hidden * (self.experts or 0)

    def shared_and_router_params(self) -> int:
        """One MoE block's shared experts and router (replicated under TP and EP)."""
        return 3 * self.dim * self.expert_hidden * (self.shared_experts or 0) + self.dim * (self.experts or 0)

    def block_params(self, index: int) -> int:
        ffn = (
            self.routed_expert_params() + self.shared_and_router_params()
            if self.is_moe_block(index)
            else self.dense_ffn_params()
        )
        return self.attention_params() + ffn + 2 * self.dim

    def params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters, or with `active` those one token passes through (its top-k experts, not all E):
        LlamaConfig.num_params."""
        total = 0
        for i in range(self.n_layers):
            if active and self.is_moe_block(i):
                routed = 3 * self.dim * self.expert_hidden * (self.top_k or 0)
                total += self.attention_params() + routed + self.shared_and_router_params() + 2 * self.dim
            else:
                total += self.block_params(i)
        emb = 2 * self.vocab_size * self.dim if embeddings else 0
        return total + self.dim + emb

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, the count the step line's TFLOP/s uses (LlamaConfig.flops_per_token)."""
        seq = self.seq_len if seq_len is None else seq_len
        dense = 6 * (self.params(embeddings=False, active=True) + self.vocab_size * self.dim)
        attention = 12 * self.n_layers * self.n_heads * self.hd * seq
        return float(dense + attention)


def shape_problem(shape: ModelShape) -> str | None:
    """Why the model cannot be built with this shape, naming the field; None when it can."""
    for field in _COUNTS:
        if (value := getattr(shape, field)) is not None and value > (limit := count_limit(field)):
            return f"{field}={value} is more than {limit:,}, past any model this could build"
    if shape.head_dim is None and shape.dim % shape.n_heads:
        return f"dim={shape.dim} is not divisible by n_heads={shape.n_heads}"
    if shape.n_heads % shape.n_kv_heads:
        return f"n_heads={shape.n_heads} is not divisible by n_kv_heads={shape.n_kv_heads}"
    if shape.hd % 2:
        return f"head dimension {shape.hd} must be even for rotary embeddings"
    if shape.is_moe:
        if (shape.top_k or 0) > (shape.experts or 0):
            return f"moe.top_k={shape.top_k} is more than moe.experts={shape.experts}"
        if not shape.moe_blocks():
            return f"moe.every={shape.every} leaves none of the {shape.n_layers} blocks a MoE block"
    return None


def check_shape(shape: ModelShape, where: str) -> ModelShape:
    """The shape, or SpecError with shape_problem's line after `where`."""
    if problem := shape_problem(shape):
        raise SpecError(f"{where}: {problem}")
    return shape


def shape_named(name: str, seq_len: int, **overrides: Any) -> ModelShape:
    """A named shape (`8B`, `debug-moe`, ...) with optional field overrides (None: keep the shape's).

    `moe` may be a mapping of MoE fields (unset ones keep the shape's, or MOE_DEFAULTS on a dense shape)."""
    if name not in SHAPE_TABLE:
        raise SpecError(f"model: unknown model {name!r}: choose one of {', '.join(SHAPE_TABLE)}")
    base = dict(SHAPE_TABLE[name])
    base_moe = base.pop("moe", None)
    moe_given = overrides.pop("moe", None)
    fields = {k: v for k, v in base.items() if k in ModelShape.__dataclass_fields__}
    heads_given = overrides.get("n_heads")
    for key, value in overrides.items():
        if value is not None:
            fields[key] = value
    if heads_given and not overrides.get("n_kv_heads"):
        # Overriding the heads alone keeps plain multi-head attention.
        fields["n_kv_heads"] = heads_given
    if base_moe is not None or moe_given is not None:
        moe = dict(base_moe or MOE_DEFAULTS)
        moe |= {k: v for k, v in (moe_given or {}).items() if v is not None and k in MOE_DEFAULTS}
        fields |= moe
    return check_shape(ModelShape(seq_len=seq_len, name=name, **fields), "model")
