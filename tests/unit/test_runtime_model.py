from __future__ import annotations

import pytest
import torch

from hpkit.errors import SpecError
from hpkit.models.llama.model import build_model, config_for
from hpkit.runtime.parallel.activation_checkpoint import apply_ac
from hpkit.runtime.parallel.compile import ALLOW_COMPILE_TP_ENV, check_compile_allowed
from hpkit.runtime.parallel.pipeline import split_model
from hpkit.runtime.parallel.tensor_parallel import select_units, tp_units

CFG = config_for("debug", 16, dim=32, n_layers=3, n_heads=4, ffn_dim=64, vocab_size=50)


def _model(seed: int = 0):
    model = build_model(CFG, "cpu")
    model.init_weights(seed)
    return model


def test_init_depends_on_seed_and_name_only():
    a, b, c = _model(0), _model(0), _model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_pipeline_stages_compose_to_the_whole_model():
    whole = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    expected = whole(tokens)
    h = tokens
    names = set()
    for stage in range(3):
        part = split_model(build_model(CFG, "meta"), 3, stage)
        part.to_empty(device="cpu")
        part.init_weights(0)
        names |= {n for n, _ in part.named_parameters()}
        h = part(h)
    assert names == {n for n, _ in whole.named_parameters()}, "stages keep the full model's names"
    torch.testing.assert_close(h, expected)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients(mode):
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    plain, wrapped = _model(), _model()
    apply_ac(wrapped, mode)
    plain(tokens).square().mean().backward()
    wrapped(tokens).square().mean().backward()
    grads_plain = [p.grad for p in plain.parameters()]
    grads_wrapped = [p.grad for p in wrapped.parameters()]
    for gp, gw in zip(grads_plain, grads_wrapped, strict=True):
        torch.testing.assert_close(gw, gp)


def test_compile_with_tp_is_refused_unless_proven(monkeypatch):
    monkeypatch.delenv(ALLOW_COMPILE_TP_ENV, raising=False)
    check_compile_allowed(True, False, "cpu")
    check_compile_allowed(False, True, "cpu")
    with pytest.raises(SpecError, match="compile with tensor parallel"):
        check_compile_allowed(True, True, "cpu")
    monkeypatch.setenv(ALLOW_COMPILE_TP_ENV, "1")
    check_compile_allowed(True, True, "cuda")


def test_tp_module_selection():
    model = build_model(CFG, "meta")
    units = tp_units(model)
    assert select_units(units, ["attention"]) == [f"layers.{i}.attention" for i in range(3)]
    assert select_units(units, ["layers.1"]) == ["layers.1.attention", "layers.1.feed_forward"]
    assert select_units(units, ["layers.*.feed_forward", "output"]) == [
        "output",
        *[f"layers.{i}.feed_forward" for i in range(3)],
    ]
    assert select_units(units, ["nothing"]) == []
