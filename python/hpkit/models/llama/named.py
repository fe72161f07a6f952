"""The Llama family's named shapes (`model.name`), as plain numbers: the one table that both the model
(hpkit.models.llama.model, which imports torch) and the planner (hpkit.plan, which runs on login nodes without torch)
read, through hpkit.models.llama.shape.shape_named.

Each entry gives the ModelShape fields; `moe`, where present, the MoE fields (a shape with one belongs to the
`moe` family: hpkit.models.families).
"""

from __future__ import annotations

from typing import Any

# `debug` is torchtitan's llama3 debug shape, so throughput compares with torchtitan directly.
SHAPE_TABLE: dict[str, dict[str, Any]] = {
    "debug": {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048},
    "125M": {
        "dim": 768,
        "n_layers": 12,
        "n_heads": 12,
        "n_kv_heads": 12,
        "ffn_dim": 2048,
        "vocab_size": 32000,
    },
    "1B": {
        "dim": 2048,
        "n_layers": 16,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_dim": 8192,
        "vocab_size": 128256,
    },
    # Llama 3 8B and 70B as published (config.json: rope_theta 500000, rms_norm_eps 1e-5, vocab 128256).
    "8B": {
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_dim": 14336,
        "vocab_size": 128256,
    },
    "70B": {
        "dim": 8192,
        "n_layers": 80,
        "n_heads": 64,
        "n_kv_heads": 8,
        "ffn_dim": 28672,
        "vocab_size": 128256,
    },
    # torchtitan's llama4 debugmodel layout, so that MoE throughput compares with torchtitan directly:
    # `debug` whose every second block routes to 8 experts of 512 (top 1) plus 1 shared expert.
    "debug-moe": {
        "dim": 256,
        "n_layers": 6,
        "n_heads": 16,
        "n_kv_heads": 16,
        "ffn_dim": 768,
        "vocab_size": 2048,
        "moe": {
            "experts": 8,
            "top_k": 1,
            "shared_experts": 1,
            "every": 2,
            "aux_loss_coef": 0.01,
            "expert_ffn_dim": 512,
        },
    },
}

# A shape's default maximum sequence length (LlamaConfig.max_seq_len): the rotary tables cover it.
DEFAULT_MAX_SEQ_LEN = 2048
