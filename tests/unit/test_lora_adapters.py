"""LoRA (hpkit.runtime.lora) in one process: the spec's checks, what apply_lora does to a model, PEFT's
initialisation, the adapter's arithmetic, and what refuses a resume. The layouts are
tests/integration/test_lora.py's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hpkit.errors import SpecError
from hpkit.models.llama import build_model, config_for, named_parameters_unwrapped
from hpkit.models.moe import MoEConfig
from hpkit.runtime.adapters import adapter_for
from hpkit.runtime.config import LORA_TARGETS, LoraSpec, RunConfig
from hpkit.runtime.lora import (
    LoRALinear,
    apply_lora,
    base_identity,
    init_lora,
    lora_record,
    resume_refusal,
)
from hpkit.validation import parse_document

TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "ffn_dim": 48, "vocab_size": 64}


def _model(moe: MoEConfig | None = None) -> torch.nn.Module:
    return build_model(config_for("debug", 16, moe=moe, **TINY), "cpu")


def test_a_target_that_names_no_module_is_one_line_naming_the_field_and_the_valid_names() -> None:
    with pytest.raises(SpecError) as err:
        parse_document(RunConfig, {"model": {"lora": {"targets": ["q_proj", "qkv_proj"]}}})
    message = str(err.value)
    assert "\n" not in message
    assert "model.lora.targets" in message and "qkv_proj" in message
    assert all(name in message for name in LORA_TARGETS)
    with pytest.raises(SpecError, match="named twice"):
        parse_document(RunConfig, {"model": {"lora": {"targets": ["q_proj", "q_proj"]}}})
    spec = parse_document(RunConfig, {"model": {"lora": {"rank": 4, "alpha": 32}}}).model.lora
    assert spec is not None and spec.targets == list(LORA_TARGETS) and spec.scaling == 8.0


def test_apply_lora_freezes_the_base_and_adds_adapters_named_as_peft_names_them() -> None:
    model = _model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    spec = LoraSpec(rank=4, targets=["q_proj", "down_proj"])
    assert apply_lora(model, spec, adapter_for("llama"), "fp32", fsdp=False) == 4
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"layers.{i}.{path}.lora_{ab}.weight"
        for i in range(2)
        for path in ("attention.wq", "feed_forward.w2")
        for ab in "AB"
    )
    # The base keeps its names (init seeds, Hugging Face loading and checkpoints key on them) and values.
    assert {n for n, _ in named_parameters_unwrapped(model)} == set(before)
    wq = model.layers["0"].attention.wq
    assert (
        isinstance(wq, LoRALinear) and wq.lora_A.weight.shape == (4, 32) and wq.lora_B.weight.shape == (32, 4)
    )
    assert not isinstance(model.layers["0"].attention.wk, LoRALinear)


def test_init_is_peft_s_and_the_same_for_every_layout() -> None:
    model = _model()
    apply_lora(model, LoraSpec(rank=4), adapter_for("llama"), "fp32", fsdp=False)
    init_lora(model, seed=3)
    wq = model.layers["0"].attention.wq
    assert torch.count_nonzero(wq.lora_B.weight) == 0  # B = 0: training starts from the base exactly
    bound = 1 / math.sqrt(32)  # kaiming_uniform_(a=sqrt(5)) on fan_in 32
    assert wq.lora_A.weight.abs().max() <= bound and wq.lora_A.weight.abs().max() > 0.8 * bound
    other = _model()
    apply_lora(other, LoraSpec(rank=4), adapter_for("llama"), "fp32", fsdp=False)
    init_lora(other, seed=3)
    assert torch.equal(other.layers["0"].attention.wq.lora_A.weight, wq.lora_A.weight)
    assert not torch.equal(model.layers["1"].attention.wq.lora_A.weight, wq.lora_A.weight)


def test_the_adapted_projection_is_base_plus_scaled_b_a() -> None:
    model = _model()
    apply_lora(model, LoraSpec(rank=4, alpha=12), adapter_for("llama"), "fp32", fsdp=False)
    wo = model.layers["1"].attention.wo
    with torch.no_grad():
        wo.lora_B.weight.normal_()
        wo.lora_A.weight.normal_()
    x = torch.randn(2, 5, 32)
    merged = wo.weight + 3.0 * wo.lora_B.weight @ wo.lora_A.weight
    torch.testing.assert_close(wo(x), F.linear(x, merged), atol=1e-5, rtol=1e-5)
    (wo(x).sum()).backward()
    assert wo.weight.grad is None and wo.lora_A.weight.grad is not None


def test_bf16_keeps_the_frozen_base_in_bf16_where_no_number_changes() -> None:
    fsdp = _model()
    apply_lora(fsdp, LoraSpec(), adapter_for("llama"), "bf16", fsdp=True)
    frozen = {p.dtype for p in fsdp.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in fsdp.parameters() if p.requires_grad} == {torch.float32}
    plain = _model()
    apply_lora(plain, LoraSpec(), adapter_for("llama"), "bf16", fsdp=False)
    # Without FSDP autocast casts only the matmuls: norms and embeddings keep fp32.
    assert plain.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    assert plain.layers["0"].attention_norm.weight.dtype == torch.float32
    assert plain.tok_embeddings.weight.dtype == torch.float32


def test_routed_experts_are_refused_in_one_line_and_attention_adapts() -> None:
    moe = MoEConfig(experts=4, top_k=1, shared_experts=0, every=1, aux_loss_coef=0.0)
    model = build_model(config_for("debug-moe", 16, moe=moe, **TINY), "meta")
    with pytest.raises(SpecError) as err:
        apply_lora(model, LoraSpec(), adapter_for("moe"), "fp32", fsdp=False)
    assert "\n" not in str(err.value) and "model.lora.targets: gate_proj" in str(err.value)
    model = build_model(config_for("debug-moe", 16, moe=moe, **TINY), "meta")
    spec = LoraSpec(targets=["q_proj", "v_proj"])
    assert apply_lora(model, spec, adapter_for("moe"), "fp32", fsdp=False) == 4


def test_base_identity_names_the_weights_not_only_the_shape(tmp_path) -> None:
    from safetensors.torch import save_file

    for name, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "llama"}')
        save_file({"w": torch.full((4, 4), value)}, str(tmp_path / name / "model.safetensors"))
    a = base_identity(str(tmp_path / "a"), {}, 0)
    assert a == base_identity(str(tmp_path / "a"), {}, 0)
    assert a["sha256"] != base_identity(str(tmp_path / "b"), {}, 0)["sha256"]
    assert base_identity(None, {"dim": 8}, 1) != base_identity(None, {"dim": 8}, 2)
    with pytest.raises(SpecError, match=r"model\.init_from"):
        base_identity(str(tmp_path / "missing"), {}, 0)


def test_a_resume_is_refused_on_another_base_or_another_kind_of_checkpoint() -> None:
    spec = LoraSpec(rank=4)
    mine = lora_record(spec, {"source": "/models/a", "sha256": "a" * 64})
    other = lora_record(spec, {"source": "/models/b", "sha256": "b" * 64})
    assert resume_refusal(mine, mine, "checkpoint c") is None
    assert resume_refusal(None, None, "checkpoint c") is None
    for theirs, ours, words in (
        (other, mine, "on the base /models/b"),
        (None, mine, "holds a whole model"),
        (mine, None, "holds LoRA adapters"),
        (lora_record(LoraSpec(rank=8), mine["base"]), mine, "rank 8"),
    ):
        refusal = resume_refusal(theirs, ours, "checkpoint c")
        assert refusal is not None and words in refusal and "\n" not in refusal
