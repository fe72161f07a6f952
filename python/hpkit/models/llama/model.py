"""The reference decoder: Llama 3 style (RMSNorm, RoPE, grouped-query attention, SwiGLU), untied embeddings.

Rotary embeddings rotate interleaved pairs (2i, 2i+1) of each head, as Meta's Llama code does; Hugging
Face's rotates the halves (i, i + head_dim/2), so hpkit.hf permutes q/k rows on load and back on export.

Written so that every parallelism can be applied from outside: blocks live in a ModuleDict keyed by
their index (pipeline stages delete blocks and keep the others' names, so checkpoints reshard across
stage layouts), and a stage without embeddings or output head takes and returns hidden states.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpkit.models.llama.moe import MoE, MoEConfig
from hpkit.models.llama.named import DEFAULT_MAX_SEQ_LEN, SHAPE_TABLE
from hpkit.models.llama.shape import MOE_DEFAULTS, ModelShape, RopeScaling, check_shape, shape_named


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    rope_scaling: RopeScaling | None = None
    # Hugging Face configs may give a head size other than dim / n_heads; None: dim / n_heads.
    attn_head_dim: int | None = None
    # Mixture of experts: some blocks' FFN becomes routed experts (hpkit.models.llama.moe); None: dense.
    moe: MoEConfig | None = None

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def shape(self) -> ModelShape:
        """The shape as plain numbers (hpkit.models.llama.shape): what the counts below and the planner read."""
        moe = asdict(self.moe) if self.moe is not None else {}
        return ModelShape(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            vocab_size=self.vocab_size,
            seq_len=self.max_seq_len,
            head_dim=self.attn_head_dim,
            **moe,
        )

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters, or with `active` those one token passes through (its top-k experts, not all E)."""
        return self.shape.params(embeddings=embeddings, active=active)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight (forward + backward) plus causal attention's score math.

        The embedding lookup is not a matmul, so it is left out; the output projection is.
        """
        return self.shape.flops_per_token(seq_len)


def config_of_shape(shape: ModelShape, max_seq_len: int | None = None, **settings: Any) -> LlamaConfig:
    """The runtime's configuration of a shape; max_seq_len None: the shape's (its sequence, at least the
    default). `settings`: the LlamaConfig fields a shape does not hold (rope, norm epsilon)."""
    moe = None
    if shape.is_moe:
        moe = MoEConfig(
            experts=shape.experts or 0,
            top_k=shape.top_k if shape.top_k is not None else MOE_DEFAULTS["top_k"],
            shared_experts=shape.shared_experts or 0,
            every=shape.every or 1,
            aux_loss_coef=shape.aux_loss_coef
            if shape.aux_loss_coef is not None
            else MOE_DEFAULTS["aux_loss_coef"],
            expert_ffn_dim=shape.expert_ffn_dim,
        )
    return LlamaConfig(
        dim=shape.dim,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        ffn_dim=shape.ffn_dim,
        vocab_size=shape.vocab_size,
        max_seq_len=shape.max_seq_len if max_seq_len is None else max_seq_len,
        attn_head_dim=shape.head_dim,
        moe=moe,
        **settings,
    )


# The named shapes (hpkit.models.llama.named), as the runtime's configurations.
SHAPES: dict[str, LlamaConfig] = {
    name: config_of_shape(shape_named(name, DEFAULT_MAX_SEQ_LEN)) for name in SHAPE_TABLE
}


def config_for(
    name: str,
    seq_len: int,
    *,
    vocab_size: int | None = None,
    dim: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    ffn_dim: int | None = None,
    moe: MoEConfig | None = None,
) -> LlamaConfig:
    """A named shape with overrides (hpkit.models.llama.shape.shape_named's rules), `moe` replacing the shape's
    MoE settings; SpecError naming the field when they make no model."""
    shape = shape_named(
        name,
        seq_len,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
    )
    if moe is not None:
        shape = check_shape(replace(shape, **asdict(moe)), "model")
    return config_of_shape(shape)


def rope_tables(cfg: LlamaConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # Real cos/sin tables rather than complex numbers: complex tensors are poorly supported by
    # some collectives and by compile.
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    if cfg.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, cfg.rope_scaling)
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    return angles.cos(), angles.sin()


def _llama3_scaled(inv_freq: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    """Llama 3.1's long-context rule: long wavelengths slow down by `factor`, short ones stay, and the
    band between blends the two linearly in 1/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def config_to_dict(cfg: LlamaConfig) -> dict:
    """Plain JSON for the checkpoint's commit record (read back torch-free by `hpkit ckpt export`)."""
    return asdict(cfg)


def config_from_dict(data: dict) -> LlamaConfig:
    data = dict(data)
    if data.get("rope_scaling"):
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    if data.get("moe"):
        data["moe"] = MoEConfig(**data["moe"])
    return LlamaConfig(**data)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate pairs (2i, 2i+1) as Llama does. Each pair is multiplied
    # as one complex number: one kernel forward and one backward, where the same rotation written with
    # real halves (select, 4 muls, sub/add, stack) costs about a dozen, each a pass over q or k.
    # The tables stay real buffers (collectives and checkpoints see no complex tensors); the complex
    # view lives only inside this function.
    seq = x.shape[1]
    # float(): FSDP's bf16 mixed precision casts a block's floating inputs, the tables among them, and
    # torch.complex takes no bf16 (it refused every bf16 FSDP step).
    if cos.dim() == 3:  # per-sample tables (batch, seq, head_dim/2): positions that restart per document
        rot = torch.complex(cos.float(), sin.float()).unsqueeze(2)
    else:
        rot = torch.complex(cos[:seq].float(), sin[:seq].float()).view(1, seq, 1, -1)
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * rot).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # packed documents: block-causal (document_mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward: nn.Module
        if cfg.moe is not None and cfg.moe.is_moe_block(index):
            n_moe = len(cfg.moe.moe_blocks(cfg.n_layers))
            self.feed_forward = MoE(cfg.moe, cfg.dim, cfg.ffn_dim, n_moe)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # The mask goes as a keyword: tensor parallel's input plan for the attention names 3 positionals.
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (batch, seq): packed documents, each restarting at 0 (chat data). Rotary positions
        then restart per document and attention stays inside it; without them, one causal sequence."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin, mask = self.rope_cos, self.rope_sin, None
        if positions is not None:
            cos, sin, mask = cos[positions], sin[positions], document_mask(positions)
        for block in self.layers.values():
            h = block(h, cos, sin, mask=mask) if mask is not None else block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from a generator seeded by (seed, its name).

        The values therefore do not depend on how the model was split or sharded: a parameter that is
        a DTensor gets its slice of the same full tensor a single-process run would draw. The full tensor
        is drawn on the parameter's device, one parameter at a time, so peak extra memory is one tensor.
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for module in self.modules():
            if isinstance(module, MoE):
                module.take_stats()  # to_empty left its counters uninitialised
        depth_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in named_parameters_unwrapped(self):
            full_shape = param.shape
            device = param.to_local().device if isinstance(param, DTensor) else param.device
            gen = torch.Generator(device=device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            if name.endswith("norm.weight"):
                full = torch.ones(full_shape, device=device)
            else:
                if name.startswith("tok_embeddings"):
                    std = 1.0
                elif name.startswith("output"):
                    std = self.cfg.dim**-0.5
                elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                    std = depth_std
                else:
                    std = 0.02
                full = torch.empty(full_shape, device=device).normal_(0.0, std, generator=gen)
                full.clamp_(-3 * std, 3 * std)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend to key j: j <= i in the same document.

    A document starts where its position is 0. An SDPA boolean mask rather than a varlen kernel: it
    runs on every device and backend (math, memory-efficient, cuDNN) that the unmasked path runs on."""
    doc = (positions == 0).cumsum(dim=1)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


def named_parameters_unwrapped(model: nn.Module):
    # Activation checkpointing and compile insert wrapper modules; the init seed uses the plain name
    # so that wrapped and unwrapped models draw the same values.
    for name, param in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if clean.endswith((".lora_A.weight", ".lora_B.weight")):
            # LoRA adapters (hpkit.runtime.loop.lora) are not the model's weights: neither initialised like
            # them nor read from a Hugging Face checkpoint; the runtime initialises them itself.
            continue
        yield clean, param


def build_model(cfg: LlamaConfig, device: torch.device | str = "meta") -> Llama:
    with torch.device(device):
        return Llama(cfg)
