"""Hugging Face Llama config.json <-> the runtime's LlamaConfig, and the tensor names between them.

A config the runtime cannot represent (biases, another activation, another rope scaling) is refused
with one line naming the config.json field, before any weight is read. Both spellings of the rotary
settings are read: transformers 4's `rope_theta` + `rope_scaling` and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpkit.errors import SpecError
from hpkit.models.llama import LlamaConfig, RopeScaling
from hpkit.models.moe import MoEConfig

CONFIG_NAME = "config.json"
# Carried from the source config into the checkpoint record and back into an export's config.json:
# they mean nothing to training but everything to generation.
PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


@dataclass(frozen=True)
class HfModel:
    """A Hugging Face Llama as the runtime sees it: its shape, tying, and the fields passed through."""

    cfg: LlamaConfig
    tied: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HfMapping:
    """A model family's Hugging Face format: its config.json both ways, and the tensor names between them.
    A family's adapter (hpkit.runtime.adapters) names its mapping; Llama's is `LLAMA` below."""

    read_config: Callable[[str | Path, int], HfModel]  # (directory, seq_len) -> shape, tying, extras
    tensor_name: Callable[[str], str]  # hpkit parameter name -> Hugging Face tensor name
    rotary_heads: Callable[[str, Any], int | None]  # heads whose rows change rotary layout, or None
    to_config: Callable[[Any, dict[str, Any], str], dict[str, Any]]  # (cfg, extras, dtype) -> config.json
    # Weights the runtime holds as one [E, ...] tensor and Hugging Face as one tensor per expert:
    # (hpkit parameter name, expert j) -> that expert's tensor name, or None for every other parameter.
    expert_tensor: Callable[[str, int], str | None] | None = None


# model_type in config.json -> the hpkit model family that loads it (hpkit.model_families).
HF_FAMILIES = {"llama": "llama", "mixtral": "moe"}


def hf_family(directory: str | Path) -> str:
    """The model family of DIR/config.json's model_type ("llama" when it cannot be read: read_config then
    names the problem)."""
    try:
        model_type = json.loads((Path(directory) / CONFIG_NAME).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "llama"
    return HF_FAMILIES.get(model_type, "llama")


def read_hf_config(directory: str | Path, seq_len: int) -> HfModel:
    """Map DIR/config.json to the runtime's shape; SpecError (one line naming the field) when it cannot."""
    path = Path(directory) / CONFIG_NAME
    where = f"model.init_from: {path}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(
            f"{where}: no such file: point init_from at a Hugging Face model directory (config.json and *.safetensors)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{where}: unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{where}: not a JSON object")
    return parse_hf_config(data, seq_len, where)


def parse_hf_config(data: dict[str, Any], seq_len: int, where: str = "config.json") -> HfModel:
    def refuse(name: str, why: str) -> SpecError:
        return SpecError(f"{where}: {name}: {why}")

    def integer(name: str, default: int | None = None) -> int:
        value = data.get(name, default)
        if value is None:
            raise refuse(name, "missing: a Llama config.json gives it")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(name, f"{value!r} is not a positive integer")
        return value

    model_type = data.get("model_type")
    if model_type not in HF_FAMILIES:
        raise refuse(
            "model_type",
            f"{model_type!r}: only Llama and Mixtral checkpoints (model_type llama, mixtral) load",
        )
    for name in ("attention_bias", "mlp_bias"):
        if data.get(name):
            raise refuse(name, "true: the runtime's Llama has no biases")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", f"{act!r}: the runtime's feed-forward is SwiGLU (silu)")
    if data.get("attention_dropout"):
        raise refuse(
            "attention_dropout", f"{data['attention_dropout']}: the runtime has no dropout; set it to 0"
        )
    dim = integer("hidden_size")
    n_heads = integer("num_attention_heads")
    n_kv_heads = integer("num_key_value_heads", n_heads)
    head_dim = integer("head_dim") if data.get("head_dim") is not None else dim // n_heads
    if n_heads % n_kv_heads:
        raise refuse("num_key_value_heads", f"{n_kv_heads} does not divide num_attention_heads={n_heads}")
    if head_dim % 2:
        raise refuse("head_dim", f"{head_dim} is odd: rotary embeddings rotate pairs")
    theta, scaling = _rope(data, refuse)
    eps = data.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise refuse("rms_norm_eps", f"{eps!r} is not a positive number")
    tied = data.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise refuse("tie_word_embeddings", f"{tied!r} is not true or false")
    cfg = LlamaConfig(
        dim=dim,
        n_layers=integer("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=integer("intermediate_size"),
        vocab_size=integer("vocab_size"),
        max_seq_len=seq_len,
        rope_theta=theta,
        norm_eps=float(eps),
        rope_scaling=scaling,
        attn_head_dim=None if head_dim == dim // n_heads else head_dim,
    )
    if model_type == "mixtral":
        cfg = replace(cfg, moe=_mixtral_moe(data, seq_len, refuse, integer))
    extras = {k: data[k] for k in PASSTHROUGH if data.get(k) is not None}
    return HfModel(cfg, tied, extras)


def _mixtral_moe(data: dict[str, Any], seq_len: int, refuse: Any, integer: Any) -> MoEConfig:
    window = data.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < seq_len):
        raise refuse(
            "sliding_window",
            f"{window!r}: the runtime attends to the whole sequence; it must be null or >= seq_len",
        )
    experts, top_k = integer("num_local_experts"), integer("num_experts_per_tok")
    if top_k > experts:
        raise refuse("num_experts_per_tok", f"{top_k} is more than num_local_experts={experts}")
    coef = data.get("router_aux_loss_coef", 0.001)
    if not isinstance(coef, (int, float)) or coef < 0:
        raise refuse("router_aux_loss_coef", f"{coef!r} is not a number >= 0")
    # Mixtral: every block's FFN is routed experts of intermediate_size, no shared expert.
    return MoEConfig(experts=experts, top_k=top_k, shared_experts=0, every=1, aux_loss_coef=float(coef))


def _rope(data: dict[str, Any], refuse: Any) -> tuple[float, RopeScaling | None]:
    # transformers 5 nests everything in rope_parameters; 4 has rope_theta beside rope_scaling
    # (whose type key was once `type`, later `rope_type`).
    if isinstance(data.get("rope_parameters"), dict):
        params, where = data["rope_parameters"], "rope_parameters"
        theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
    else:
        params, where = data.get("rope_scaling") or {}, "rope_scaling"
        theta = data.get("rope_theta", 10000.0)
    if not isinstance(params, dict):
        raise refuse(where, f"{params!r} is not an object")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise refuse("rope_theta", f"{theta!r} is not a positive number")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise refuse(
            f"{where}.rope_type", f"{kind!r}: the runtime implements only the default and llama3 scaling"
        )
    values = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = params.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise refuse(f"{where}.{name}", f"{value!r}: llama3 rope scaling needs a positive number")
        values[name] = value
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise refuse(f"{where}.high_freq_factor", "must be larger than low_freq_factor")
    return float(theta), RopeScaling(
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=int(values["original_max_position_embeddings"]),
    )


def to_hf_config(cfg: LlamaConfig, extras: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json for LlamaForCausalLM (transformers 4 spelling, which 5 reads too). Always untied:
    the runtime trains the output head apart from the embeddings, so an export carries both."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": cfg.max_seq_len,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    out.update(extras)
    return out


# hpkit parameter name (inside a block) -> Hugging Face name (inside model.layers.N)
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of an hpkit parameter name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    prefix, _, rest = name.partition(".")
    index, _, inner = rest.partition(".")
    if prefix == "layers" and inner in _BLOCK_NAMES:
        return f"model.layers.{index}.{_BLOCK_NAMES[inner]}"
    raise KeyError(f"{name}: no Hugging Face Llama tensor corresponds")


def rotary_heads(name: str, cfg: LlamaConfig) -> int | None:
    """Heads whose rows must be permuted between the two rotary layouts (q and k projections), or None."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


LLAMA = HfMapping(read_hf_config, hf_name, rotary_heads, to_hf_config)


def mixtral_name(name: str) -> str:
    """Mixtral's tensor name of an hpkit parameter (the routed experts: see mixtral_expert_tensor)."""
    prefix, _, rest = name.partition(".")
    index, _, inner = rest.partition(".")
    if prefix == "layers" and inner == "feed_forward.router.gate.weight":
        return f"model.layers.{index}.block_sparse_moe.gate.weight"
    if prefix == "layers" and inner.startswith("feed_forward.experts."):
        return f"model.layers.{index}.block_sparse_moe.experts"
    return hf_name(name)


def mixtral_expert_tensor(name: str, expert: int) -> str | None:
    """experts.w1/w2/w3 ([E, ...]) of block N -> model.layers.N.block_sparse_moe.experts.{j}.w1/w2/w3.weight."""
    prefix, _, rest = name.partition(".")
    index, _, inner = rest.partition(".")
    weight = inner.removeprefix("feed_forward.experts.")
    if prefix != "layers" or weight == inner or weight not in ("w1", "w2", "w3"):
        return None
    return f"model.layers.{index}.block_sparse_moe.experts.{expert}.{weight}.weight"


def to_mixtral_config(cfg: LlamaConfig, extras: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json for MixtralForCausalLM. Mixtral routes every block's FFN and has no shared expert, so a
    MoE with dense blocks or shared experts has no Mixtral form and is refused in one line."""
    moe = cfg.moe
    if moe is None or moe.every != 1 or moe.shared_experts:
        raise SpecError(
            "a Mixtral checkpoint routes every block's FFN and has no shared experts; this model has "
            f"moe.every={moe.every if moe else None}, shared_experts={moe.shared_experts if moe else None}: "
            "no Hugging Face format holds it"
        )
    if cfg.rope_scaling is not None:
        raise SpecError("a Mixtral config has no Llama 3 rope scaling; this model has one")
    out = to_hf_config(cfg, {}, dtype)
    out.pop("rope_scaling", None)
    out.pop("mlp_bias", None)
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=moe.expert_ffn_dim or cfg.ffn_dim,
        num_local_experts=moe.experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False,
        sliding_window=None,
    )
    out.update(extras)
    return out


MIXTRAL = HfMapping(read_hf_config, mixtral_name, rotary_heads, to_mixtral_config, mixtral_expert_tensor)
