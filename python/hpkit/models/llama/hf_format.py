"""Hugging Face Llama config.json <-> the runtime's LlamaConfig, and the tensor names between them.

config.json is read by hpkit.models.llama.config_json (the planner's parser too), which refuses in one line naming the
field what the runtime cannot represent; this module turns what it reads into a LlamaConfig, and writes an
export's config.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpkit.errors import SpecError
from hpkit.models.adapter import HfMapping, HfModel
from hpkit.models.llama import config_json
from hpkit.models.llama.config_json import CONFIG_NAME, load_config_json
from hpkit.models.llama.model import LlamaConfig, config_of_shape


def read_hf_config(directory: str | Path, seq_len: int) -> HfModel:
    """Map DIR/config.json to the runtime's shape; SpecError (one line naming the field) when it cannot."""
    data = load_config_json(
        directory,
        lambda path: f"model.init_from: {path}",
        "point init_from at a Hugging Face model directory (config.json and *.safetensors)",
    )
    return parse_hf_config(data, seq_len, f"model.init_from: {Path(directory) / CONFIG_NAME}")


def parse_hf_config(data: dict[str, Any], seq_len: int, where: str = "config.json") -> HfModel:
    """hpkit.models.llama.config_json's reading of a config.json, as the runtime's LlamaConfig (its max_seq_len: seq_len)."""
    hf = config_json.parse_hf_config(data, seq_len, where)
    cfg = config_of_shape(
        hf.shape,
        max_seq_len=seq_len,
        rope_theta=hf.rope_theta,
        norm_eps=hf.norm_eps,
        rope_scaling=hf.rope_scaling,
    )
    return HfModel(cfg, hf.tied, hf.extras)


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
