"""LoRA (hpkit.runtime.loop.lora) in one process: the spec's checks, what apply_lora does to a model, PEFT's
initialisation, the adapter's arithmetic, and what refuses a resume; and the adapters' placements under
tensor parallel, in two real gloo processes. The layouts are tests/integration/test_lora.py's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _gloo import run_ranks

from hpkit.errors import SpecError
from hpkit.models.adapters import adapter_for
from hpkit.models.llama.model import build_model, config_for, named_parameters_unwrapped
from hpkit.models.llama.moe import MoEConfig
from hpkit.runtime.config import LORA_TARGETS, LoraSpec, RunConfig
from hpkit.runtime.loop.lora import (
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


def assert_adapted(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float
) -> None:
    """`got` is x (W + scaling B A)^T up to fp32 rounding, element by element.

    The adapter computes W x + scaling B (A x); the reference merges W + scaling B A first. Each is a sum of
    at most n = in + rank + 2 rounded terms per element (the dot over the input, the one over the rank, the
    scaling and the sum), so each lies within gamma_n |x| (|W| + scaling |B| |A|)^T of the exact value, with
    gamma_n = n u / (1 - n u) and u fp32's unit roundoff (Higham, Accuracy and Stability, 3.1): the two within
    twice that of each other. A fixed tolerance sat at the edge of what the rounding does (1.02e-5 against
    1e-5, one element of 320); this bound follows from it, and is still far below what a wrong scaling or a
    missing B A changes (checked here)."""
    n = w.shape[1] + a.shape[0] + 2
    u = torch.finfo(torch.float32).eps / 2
    gamma = n * u / (1 - n * u)
    magnitude = x.abs() @ (w.abs() + scaling * b.abs() @ a.abs()).T
    bound = 2 * gamma * magnitude
    want = F.linear(x, w + scaling * b @ a)
    assert got.shape == want.shape
    excess = (got - want).abs() - bound
    assert (excess <= 0).all(), f"off by more than fp32 rounding allows at {int((excess > 0).sum())} elements"
    adapter_part = (scaling * F.linear(F.linear(x, a), b)).abs()
    assert (bound < 0.01 * adapter_part.mean()).all(), "the bound must leave a wrong adapter path visible"


def test_the_adapted_projection_is_base_plus_scaled_b_a() -> None:
    model = _model()
    apply_lora(model, LoraSpec(rank=4, alpha=12), adapter_for("llama"), "fp32", fsdp=False)
    wo = model.layers["1"].attention.wo
    with torch.no_grad():
        wo.lora_B.weight.normal_()
        wo.lora_A.weight.normal_()
    x = torch.randn(2, 5, 32)
    assert_adapted(wo(x), x, wo.weight, wo.lora_B.weight, wo.lora_A.weight, 3.0)
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


def _adapters_under_tensor_parallel(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hpkit.runtime.parallel.tensor_parallel import apply_tp

    adapter = adapter_for("llama")
    model = build_model(config_for("debug", 16, **TINY), "meta")
    mesh = init_device_mesh("cpu", (world,))
    # As the trainer does: tensor parallel, then the adapters, then the weights.
    apply_tp(model, mesh, None, loss_parallel=False, sequence_parallel=False, adapter=adapter)
    spec = LoraSpec(rank=4, alpha=12)
    apply_lora(model, spec, adapter, "fp32", fsdp=False)
    model.to_empty(device="cpu")
    adapter.init_weights(model, 0)
    init_lora(model, 0)
    attention = model.layers["0"].attention
    colwise, rowwise = attention.wq, attention.wo
    assert colwise.weight.placements == (Shard(0),) and rowwise.weight.placements == (Shard(1),)
    # Column-parallel W (its output dim split): B split like it, A whole, so that B A x is split like W x.
    assert colwise.lora_A.weight.placements == (Replicate(),), colwise.lora_A.weight.placements
    assert colwise.lora_B.weight.placements == (Shard(0),), colwise.lora_B.weight.placements
    assert colwise.lora_B.weight.to_local().shape == (32 // world, 4)
    # Row-parallel W (its input dim split): A split like it, B whole: B A x is a partial sum reduced with W x's.
    assert rowwise.lora_A.weight.placements == (Shard(1),), rowwise.lora_A.weight.placements
    assert rowwise.lora_B.weight.placements == (Replicate(),), rowwise.lora_B.weight.placements
    assert rowwise.lora_A.weight.to_local().shape == (4, 32 // world)
    # The numbers: each projection's output is this rank's part of x W^T + scaling x (B A)^T, with B != 0.
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for linear in (colwise, rowwise):
            for layer in (linear.lora_A, linear.lora_B):
                full = torch.randn(layer.weight.shape, generator=gen)
                layer.weight.copy_(distribute_tensor(full, mesh, layer.weight.placements))
        x = torch.randn(2, 5, 32, generator=gen)
        for linear in (colwise, rowwise):
            w, b, a = (t.full_tensor() for t in (linear.weight, linear.lora_B.weight, linear.lora_A.weight))
            if linear is colwise:  # x whole in, this rank's columns of the output out
                got = linear(x)
                w, b = w.chunk(world)[rank], b.chunk(world)[rank]
            else:  # this rank's part of x in (as the column-parallel projection before it gives), all of it out
                got = linear(x.chunk(world, dim=-1)[rank])
            assert_adapted(got, x, w, b, a, spec.scaling)


def test_under_tensor_parallel_each_adapter_matrix_is_split_as_its_base_weight_needs(tmp_path) -> None:
    run_ranks(_adapters_under_tensor_parallel, 2, tmp_path)
