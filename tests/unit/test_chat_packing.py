"""Packed conversations in the model: attention never crosses a document, and positions restart in each.

A packed row of three documents gives each document the logits it has alone; changing one document's tokens
leaves the other two's logits unchanged (and without the positions, i.e. one causal sequence, it would not)."""

from __future__ import annotations

import torch

from hpkit.models.llama.model import LlamaConfig, build_model, document_mask

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=32)
LENGTHS = (7, 5, 8)  # three documents, 20 tokens


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(CFG, "cpu")
    model.init_weights(3)
    return model.eval()


def _row(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, CFG.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(seed)
    )
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return tokens, positions


def _spans() -> list[slice]:
    ends = torch.tensor(LENGTHS).cumsum(0).tolist()
    return [slice(e - n, e) for n, e in zip(LENGTHS, ends, strict=True)]


@torch.no_grad()
def test_each_packed_document_has_the_logits_it_has_alone():
    model = _model()
    tokens, positions = _row(1)
    packed = model(tokens, positions)
    for span in _spans():
        alone = model(tokens[:, span])
        torch.testing.assert_close(packed[:, span], alone, atol=1e-5, rtol=0)


@torch.no_grad()
def test_changing_one_document_leaves_the_others_logits_unchanged():
    model = _model()
    tokens, positions = _row(2)
    changed = tokens.clone()
    middle = _spans()[1]
    changed[:, middle] = (changed[:, middle] + 1) % CFG.vocab_size
    before, after = model(tokens, positions), model(changed, positions)
    first, _, last = _spans()
    assert torch.equal(before[:, first], after[:, first])
    torch.testing.assert_close(before[:, last], after[:, last], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, middle], after[:, middle], atol=1e-3)
    # The check can fail: as one causal sequence (no positions) the last document sees the change.
    assert not torch.allclose(model(tokens)[:, last], model(changed)[:, last], atol=1e-3)


@torch.no_grad()
def test_one_document_of_positions_is_the_plain_causal_path():
    model = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(model(tokens, positions), model(tokens), atol=1e-5, rtol=0)


def test_document_mask_is_block_causal():
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
