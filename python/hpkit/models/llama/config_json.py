"""Hugging Face's config.json of a Llama or Mixtral checkpoint, read into a shape: the one parser.

The runtime (hpkit.models.llama.hf_format: model.init_from, `hpkit ckpt export --hf`) builds its LlamaConfig from what this
reads, and the planner (`hpkit plan FOLDER`, a spec's init_from) plans the same shape. A config the runtime
cannot represent (biases, another activation, another rope scaling) is refused with one line naming the
config.json field, before any weight is read. Both spellings of the rotary settings are read: transformers 4's
`rope_theta` + `rope_scaling` and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpkit.errors import SpecError
from hpkit.models.llama.shape import ModelShape, RopeScaling, count_limit

CONFIG_NAME = "config.json"
# config.json's model_type -> the family (hpkit.models.families) that loads it: model.init_from, `hpkit plan FOLDER`.
HF_FAMILIES = {"llama": "llama", "mixtral": "moe"}
# Carried from the source config into the checkpoint record and back into an export's config.json:
# they mean nothing to training but everything to generation.
PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


@dataclass(frozen=True)
class HfDefaults:
    """What transformers' config class of a model_type takes for a field a config.json leaves out, so that a
    trimmed or hand-written config builds the model transformers builds from it."""

    n_kv_heads: int | None  # num_key_value_heads; None: the number of attention heads
    rope_theta: float
    rms_norm_eps: float


# The families differ: Mixtral's defaults are grouped-query attention with 8 KV heads, rope_theta 1e6 and eps 1e-5.
HF_DEFAULTS = {
    "llama": HfDefaults(n_kv_heads=None, rope_theta=10000.0, rms_norm_eps=1e-6),
    "mixtral": HfDefaults(n_kv_heads=8, rope_theta=1e6, rms_norm_eps=1e-5),
}


@dataclass(frozen=True)
class HfConfig:
    """A config.json as hpkit reads it: the shape, and the settings of the model that no count depends on."""

    shape: ModelShape  # seq_len: the one asked for; name: _name_or_path, else model_type
    rope_theta: float
    rope_scaling: RopeScaling | None
    norm_eps: float
    tied: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # PASSTHROUGH fields present


def load_config_json(directory: str | Path, where: Callable[[Path], str], missing: str) -> dict[str, Any]:
    """DIR/config.json as a dict; SpecError `where(path): ...` when it is missing (with the caller's hint,
    `missing`), unreadable or not an object."""
    path = Path(directory) / CONFIG_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{where(path)}: no such file: {missing}") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise SpecError(f"{where(path)}: unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{where(path)}: not a JSON object")
    return data


def parse_hf_config(data: dict[str, Any], seq_len: int, where: str = "config.json") -> HfConfig:
    def refuse(name: str, why: str) -> SpecError:
        return SpecError(f"{where}: {name}: {why}")

    def integer(name: str, default: int | None = None) -> int:
        value = data.get(name, default)
        if value is None:
            raise refuse(name, "missing: a Llama config.json gives it")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(name, f"{value!r} is not a positive integer")
        if value > (limit := count_limit("n_layers" if name == "num_hidden_layers" else name)):
            raise refuse(name, f"{value} is more than {limit:,}, past any model this could build")
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
    defaults = HF_DEFAULTS[model_type]
    n_kv_heads = integer("num_key_value_heads", defaults.n_kv_heads or n_heads)
    head_dim = integer("head_dim") if data.get("head_dim") is not None else dim // n_heads
    if n_heads % n_kv_heads:
        raise refuse("num_key_value_heads", f"{n_kv_heads} does not divide num_attention_heads={n_heads}")
    if head_dim % 2:
        raise refuse("head_dim", f"{head_dim} is odd: rotary embeddings rotate pairs")
    theta, scaling = _rope(data, refuse, defaults.rope_theta)
    eps = data.get("rms_norm_eps", defaults.rms_norm_eps)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise refuse("rms_norm_eps", f"{eps!r} is not a positive number")
    tied = data.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise refuse("tie_word_embeddings", f"{tied!r} is not true or false")
    shape = ModelShape(
        dim=dim,
        n_layers=integer("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=integer("intermediate_size"),
        vocab_size=integer("vocab_size"),
        seq_len=seq_len,
        head_dim=None if head_dim == dim // n_heads else head_dim,
        name=str(data.get("_name_or_path") or model_type),
    )
    if model_type == "mixtral":
        shape = _mixtral_moe(shape, data, seq_len, refuse, integer)
    extras = {k: data[k] for k in PASSTHROUGH if data.get(k) is not None}
    return HfConfig(shape, float(theta), scaling, float(eps), tied, extras)


def _mixtral_moe(
    shape: ModelShape, data: dict[str, Any], seq_len: int, refuse: Any, integer: Any
) -> ModelShape:
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
    return replace(shape, experts=experts, top_k=top_k, shared_experts=0, every=1, aux_loss_coef=float(coef))


def _rope(data: dict[str, Any], refuse: Any, default_theta: float) -> tuple[float, RopeScaling | None]:
    # transformers 5 nests everything in rope_parameters; 4 has rope_theta beside rope_scaling
    # (whose type key was once `type`, later `rope_type`).
    if isinstance(data.get("rope_parameters"), dict):
        params, where = data["rope_parameters"], "rope_parameters"
        theta = params.get("rope_theta", data.get("rope_theta", default_theta))
    else:
        params, where = data.get("rope_scaling") or {}, "rope_scaling"
        theta = data.get("rope_theta", default_theta)
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
