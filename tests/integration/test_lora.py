"""LoRA on a tiny Hugging Face Llama (model.init_from), in one process and in dp2 x tp2 and pp2 x dp2 (one 4-process
torchrun runs both), and its export against peft and transformers (implementations no one here wrote).

Two launches in one module fixture (tests/integration/lora_layouts.py): a plain process (the reference layout, a
checkpoint, its resume, a resume on another base, a 125M LoRA checkpoint) and torchrun with 4 processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _torchrun import REPO, run_together
from lora_layouts import LORA, TOKENS
from safetensors.torch import load_file, save_file

from hpkit.commands import ckpt
from hpkit.errors import HpkitError

sys.path.insert(0, str(REPO / "tests" / "unit"))
from test_hf_weights import make_hf

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent

LAYOUTS = ("single", "dp2_tp2", "pp2_dp2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    base, other = root / "base", root / "other"
    make_hf(base)  # GQA (4 heads, 2 kv heads): q and k rows change rotary layout on export
    make_hf(other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] += 0.01  # the same shape, other weights
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    out = root / "out"
    out.mkdir()
    script = str(HERE / "lora_layouts.py")
    args = [script, str(base), str(other), str(out)]
    # The two launches write apart (the 1-process extras under out/ckpt*, each its layouts-N.json): together.
    run_together({1: (args, root / "tmp1", None), 4: (args, root / "tmp4", 4)})
    results = json.loads((out / "layouts-1.json").read_text())
    results |= json.loads((out / "layouts-4.json").read_text())
    return {"results": results, "out": out, "base": base}


def test_base_weights_stay_bitwise_and_every_adapter_gets_a_gradient_in_every_layout(runs: dict) -> None:
    results = runs["results"]
    reference = results["single"]["base_before"]
    assert len(reference) == 2 * 9 + 3  # every weight of the model is frozen and compared
    for layout in LAYOUTS:
        got = results[layout]
        assert got["base_before"] == reference, layout  # the same base loaded in every layout
        assert got["base_after"] == reference, layout  # and not one bit of it moved
        # The last step's gradients: B starts at zero, so A's are zero at step 1 and not after.
        assert len(got["adapter_grad_nonzero"]) == 2 * 7 * 2, layout
        assert all(got["adapter_grad_nonzero"].values()), (layout, got["adapter_grad_nonzero"])
        assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in got["optimizer_params"])
        assert len(got["optimizer_params"]) == 2 * 7 * 2, layout


def test_under_bf16_with_fsdp_the_frozen_base_is_bf16_and_still_bitwise_unchanged(runs: dict) -> None:
    got, fp32 = runs["results"]["fsdp4_bf16"], runs["results"]["single"]
    assert got["frozen_dtypes"] == ["torch.bfloat16"] and fp32["frozen_dtypes"] == ["torch.float32"]
    assert got["base_after"] == got["base_before"]
    assert all(got["adapter_grad_nonzero"].values()) and len(got["adapter_grad_nonzero"]) == 2 * 7 * 2
    assert got["loss"] == pytest.approx(fp32["loss"], abs=0.05)  # bf16 matmuls: close, not equal


def test_losses_are_equal_across_layouts_and_training_moves_them(runs: dict) -> None:
    results = runs["results"]
    single = results["single"]["loss"]
    for layout in LAYOUTS[1:]:
        assert results[layout]["loss"] == pytest.approx(single, abs=1e-5), layout
    assert len(set(single)) == len(single)  # the adapters train: every step's loss differs


def test_the_peft_adapter_loads_with_peft_and_gives_hpkit_s_logits(runs: dict, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    out = tmp_path / "adapter"
    assert ckpt.main(["export", "--hf", str(runs["out"] / "ckpt"), str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (LORA["rank"], LORA["alpha"])
    # PEFT's own names for these targets on this model, from a model PEFT adapted itself.
    fresh = get_peft_model(
        LlamaForCausalLM.from_pretrained(runs["base"], dtype=torch.float32),
        LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"]),
    )
    assert set(load_file(str(out / "adapter_model.safetensors"))) == set(get_peft_model_state_dict(fresh))
    base = LlamaForCausalLM.from_pretrained(runs["base"], dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(TOKENS).logits
        model = PeftModel.from_pretrained(base, out).eval()
        got = model(TOKENS).logits
    want = torch.load(runs["out"] / "logits.pt")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (before - want).abs().max() > 1e-2  # the adapters changed the model: the match means something


def test_the_merged_export_is_base_plus_scaled_b_a(runs: dict, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert ckpt.main(["export", "--hf", str(runs["out"] / "ckpt"), str(adapter)]) == 0
    assert ckpt.main(["export", "--hf", "--merge", str(runs["out"] / "ckpt"), str(merged)]) == 0
    base = load_file(str(runs["base"] / "model.safetensors"))
    pairs = load_file(str(adapter / "adapter_model.safetensors"))
    got = load_file(str(merged / "model.safetensors"))
    assert set(got) == set(base)
    scaling = LORA["alpha"] / LORA["rank"]
    adapted = 0
    for name, weight in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" in pairs:
            want = weight + scaling * pairs[f"{stem}.lora_B.weight"] @ pairs[f"{stem}.lora_A.weight"]
            torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-6)
            assert not torch.equal(got[name], weight)
            adapted += 1
        else:
            assert torch.equal(got[name], weight), name
    assert adapted == 2 * 7
    model = LlamaForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    torch.testing.assert_close(logits, torch.load(runs["out"] / "logits.pt"), atol=1e-4, rtol=0)
    with pytest.raises(HpkitError, match="not empty"):
        ckpt.main(["export", "--hf", "--merge", str(runs["out"] / "ckpt"), str(merged)])


def test_the_125m_lora_checkpoint_is_under_a_twentieth_of_a_whole_one(runs: dict) -> None:
    extras = runs["results"]["single"]["extras"]
    # A whole checkpoint holds at least every parameter and AdamW's two moments, in fp32.
    whole_at_least = extras["125M_params"] * 4 * 3
    assert extras["125M_lora_bytes"] * 20 <= whole_at_least, extras
    # and the LoRA one holds the adapters and their moments, not the base (whose weights alone are 10x more).
    assert extras["125M_lora_bytes"] < extras["125M_params"] * 4 / 10
    assert extras["125M_lora_bytes"] > extras["125M_trainable"] * 4 * 3


def test_a_resume_takes_its_adapters_back_and_another_base_is_refused_in_one_line(runs: dict) -> None:
    extras = runs["results"]["single"]["extras"]
    assert extras["resumed_step"] == 4 and extras["resumed_adapters_equal"], extras
    refusal = extras["other_base"]
    assert refusal is not None and "\n" not in refusal
    assert "trained adapters on the base" in refusal and "model.init_from" in refusal
