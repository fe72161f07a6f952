"""A model's shape as the planner sees it: the numbers memory and speed depend on, read without torch.

Three sources, one answer each: a named shape (hpkit.model_shapes, the table hpkit.models.llama builds its
configs from), a spec's `model:` block (a named shape with overrides, or `init_from`), or a Hugging Face
config.json folder (Llama and Mixtral). The rules mirror the runtime's (hpkit.models.llama.config_for, the
MoE adapter's defaults, hpkit.hf.config.parse_hf_config); tests/unit/test_plan_memory.py keeps them equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpkit.errors import SpecError
from hpkit.model_families import SHAPE_NAMES, family_for
from hpkit.model_shapes import DEFAULT_MAX_SEQ_LEN, SHAPE_TABLE

if TYPE_CHECKING:
    from hpkit.runtime.config import ModelSpec

# The MoE adapter's defaults for model.moe fields a spec leaves unset on a dense shape (MoEConfig's).
MOE_DEFAULTS: dict[str, Any] = {
    "experts": 8,
    "top_k": 2,
    "shared_experts": 0,
    "every": 1,
    "expert_ffn_dim": None,
}
# config.json model_type -> family; hpkit.hf.config.HF_FAMILIES (torch-bound) is the runtime's copy.
HF_MODEL_TYPES = {"llama": "llama", "mixtral": "moe"}


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
        """The dimensions tensor parallel splits (hpkit.arch.parallel.tp_problem's keywords)."""
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


def _check(shape: ModelShape, where: str) -> ModelShape:
    """config_for's rules, as one line naming the field."""
    if shape.head_dim is None and shape.dim % shape.n_heads:
        raise SpecError(f"{where}: dim={shape.dim} is not divisible by n_heads={shape.n_heads}")
    if shape.n_heads % shape.n_kv_heads:
        raise SpecError(f"{where}: n_heads={shape.n_heads} is not divisible by n_kv_heads={shape.n_kv_heads}")
    if shape.hd % 2:
        raise SpecError(f"{where}: head dimension {shape.hd} must be even for rotary embeddings")
    if shape.is_moe:
        if (shape.top_k or 0) > (shape.experts or 0):
            raise SpecError(f"{where}: moe.top_k={shape.top_k} is more than moe.experts={shape.experts}")
        if not shape.moe_blocks():
            raise SpecError(
                f"{where}: moe.every={shape.every} leaves none of the {shape.n_layers} blocks a MoE block"
            )
    return shape


def shape_named(name: str, seq_len: int, **overrides: Any) -> ModelShape:
    """A named shape (`8B`, `debug-moe`, ...) with optional field overrides (None: keep the shape's).

    `moe` may be a mapping of MoE fields (unset ones keep the shape's, or MOE_DEFAULTS on a dense shape)."""
    if name not in SHAPE_TABLE:
        raise SpecError(f"model: unknown model {name!r}: choose one of {', '.join(SHAPE_NAMES)}")
    base = dict(SHAPE_TABLE[name])
    base_moe = base.pop("moe", None)
    moe_given = overrides.pop("moe", None)
    fields = {k: v for k, v in base.items() if k in ModelShape.__dataclass_fields__}
    heads_given = overrides.get("n_heads")
    for key, value in overrides.items():
        if value is not None:
            fields[key] = value
    if heads_given and not overrides.get("n_kv_heads"):
        # Overriding the heads alone keeps plain multi-head attention (config_for's rule).
        fields["n_kv_heads"] = heads_given
    if base_moe is not None or moe_given is not None:
        moe = {k: v for k, v in (base_moe or MOE_DEFAULTS).items() if k in MOE_DEFAULTS}
        moe |= {k: v for k, v in (moe_given or {}).items() if v is not None and k in MOE_DEFAULTS}
        fields |= moe
    return _check(ModelShape(seq_len=seq_len, name=name, **fields), "model")


def shape_of_spec(model: ModelSpec) -> ModelShape:
    """The shape a spec's `model:` block trains: the named shape with its overrides, or init_from's config.json."""
    if model.init_from:
        return with_lora(model, shape_from_hf(model.init_from, model.seq_len))
    family_for(model.name, model.moe is not None)  # the same lookup the trainer makes
    moe = model.moe.model_dump() if model.moe is not None else None
    return with_lora(model, _named_of_spec(model, moe))


def with_lora(model: ModelSpec, shape: ModelShape) -> ModelShape:
    lora = getattr(model, "lora", None)
    if lora is None:
        return shape
    return replace(shape, lora_rank=lora.rank, lora_targets=tuple(lora.targets))


def _named_of_spec(model: ModelSpec, moe: dict[str, Any] | None) -> ModelShape:
    return shape_named(
        model.name,
        model.seq_len,
        vocab_size=model.vocab_size,
        dim=model.dim,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        ffn_dim=model.ffn_dim,
        moe=moe,
    )


def shape_from_hf(directory: str | Path, seq_len: int) -> ModelShape:
    """DIR/config.json of a Llama or Mixtral checkpoint; SpecError naming the field for anything else."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(
            f"{path}: no such file: name a Hugging Face model folder (with config.json)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: not a JSON object")
    return parse_hf(data, seq_len, str(path))


def parse_hf(data: dict[str, Any], seq_len: int, where: str = "config.json") -> ModelShape:
    def integer(name: str, default: int | None = None) -> int:
        value = data.get(name, default)
        if value is None:
            raise SpecError(f"{where}: {name}: missing: a Llama config.json gives it")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{where}: {name}: {value!r} is not a positive integer")
        return value

    model_type = data.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise SpecError(
            f"{where}: model_type: {model_type!r}: only Llama and Mixtral checkpoints (model_type llama, "
            "mixtral) can be planned"
        )
    dim, n_heads = integer("hidden_size"), integer("num_attention_heads")
    head_dim = integer("head_dim") if data.get("head_dim") is not None else None
    shape = ModelShape(
        dim=dim,
        n_layers=integer("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=integer("num_key_value_heads", n_heads),
        ffn_dim=integer("intermediate_size"),
        vocab_size=integer("vocab_size"),
        seq_len=seq_len,
        head_dim=None if head_dim == dim // n_heads else head_dim,
        name=str(data.get("_name_or_path") or model_type),
    )
    if model_type == "mixtral":
        # Mixtral: every block's FFN is routed experts of intermediate_size, no shared expert.
        shape = replace(
            shape,
            experts=integer("num_local_experts"),
            top_k=integer("num_experts_per_tok"),
            shared_experts=0,
            every=1,
        )
    return _check(shape, where)


def resolve_model(model: str | Path, seq_len: int) -> ModelShape:
    """`hpkit plan MODEL`: a shape name, or a folder holding a Hugging Face config.json."""
    text = str(model)
    if text in SHAPE_TABLE:
        return shape_named(text, seq_len)
    if Path(text).is_dir():
        return shape_from_hf(text, seq_len)
    raise SpecError(
        f"model {text!r}: neither a shape name ({', '.join(SHAPE_NAMES)}) nor a folder with a Hugging Face "
        "config.json"
    )
