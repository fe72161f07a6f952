from __future__ import annotations

import numpy as np
import pytest
import torch

from hpkit.errors import SpecError
from hpkit.runtime.loop.data import DataLoader, SyntheticTokens, TokenFile, build_source


def _global_batch(source, local: int, dp: int, position: int = 0) -> torch.Tensor:
    parts = []
    for rank in range(dp):
        loader = DataLoader(source, local, dp_rank=rank, dp_degree=dp, position=position)
        inputs, labels = loader.next_batch()
        assert torch.equal(inputs[:, 1:], labels[:, :-1]), "labels are the inputs shifted by one"
        parts.append(inputs)
        assert loader.position == position + local * dp
    return torch.cat(parts)


def test_synthetic_is_deterministic_and_in_range():
    a, b = SyntheticTokens(100, 16, seed=3), SyntheticTokens(100, 16, seed=3)
    assert torch.equal(a.sample(7), b.sample(7))
    assert not torch.equal(a.sample(7), a.sample(8))
    assert not torch.equal(a.sample(7), SyntheticTokens(100, 16, seed=4).sample(7))
    s = a.sample(5)
    assert s.shape == (17,) and s.dtype == torch.int64 and s.min() >= 0 and s.max() < 100


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_the_global_batch_does_not_depend_on_the_dp_degree(dp):
    source = SyntheticTokens(64, 8, seed=0)
    reference = _global_batch(source, 8, 1, position=16)
    assert torch.equal(_global_batch(source, 8 // dp, dp, position=16), reference)


def test_resume_continues_the_stream():
    source = SyntheticTokens(64, 8, seed=0)
    straight = DataLoader(source, 2, 0, 2)
    batches = [straight.next_batch()[0] for _ in range(3)]
    resumed = DataLoader(source, 2, 0, 2)
    resumed.load_state_dict({"position": 4})
    assert torch.equal(resumed.next_batch()[0], batches[1])
    assert resumed.state_dict() == {"position": 8}


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_a_seeded_permutation(tmp_path, dtype):
    seq = 4
    tokens = np.arange(41, dtype=dtype)  # 10 windows of 4 (+1 label token)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    source = TokenFile(path, dtype, seq, seed=1, vocab_size=1000)
    assert len(source) == 10
    starts = sorted(int(source.sample(i)[0]) for i in range(10))
    assert starts == list(range(0, 40, 4)), "one epoch visits every window once"
    window = source.sample(3)
    assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + seq + 1))
    again = TokenFile(path, dtype, seq, seed=1, vocab_size=1000)
    assert all(torch.equal(source.sample(i), again.sample(i)) for i in range(25))
    second_epoch = [int(source.sample(i)[0]) for i in range(10, 20)]
    assert sorted(second_epoch) == starts and second_epoch != [int(source.sample(i)[0]) for i in range(10)]


def test_token_file_errors(tmp_path):
    with pytest.raises(SpecError, match="is not a file"):
        TokenFile(tmp_path / "missing.bin", "uint16", 4, 0, 100)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(SpecError, match="not a whole number of uint16"):
        TokenFile(odd, "uint16", 4, 0, 100)
    big = tmp_path / "big.bin"
    np.full(20, 500, dtype="uint16").tofile(big)
    with pytest.raises(SpecError, match="vocabulary is 100"):
        TokenFile(big, "uint16", 4, 0, 100).sample(0)
    assert isinstance(build_source("synthetic", None, "uint16", 4, 0, 100), SyntheticTokens)


def _prepared_dir(tmp_path, shard_lengths: list[int], vocab: int = 1000, dtype: str = "uint16"):
    """A directory in `hpkit data prepare`'s format, made by hand: tokens 0, 1, 2, ... over the shards."""
    import hashlib
    import json

    shards, start = [], 0
    for n, length in enumerate(shard_lengths):
        data = np.arange(start, start + length, dtype=dtype)
        name = f"shard-{n:05d}.bin"
        data.tofile(tmp_path / name)
        shards.append({"name": name, "tokens": length, "sha256": hashlib.sha256(data.tobytes()).hexdigest()})
        start += length
    index = {"format": "hpkit-prepared", "version": 1, "dtype": dtype, "shards": shards, "documents": 3}
    index.update(vocab_size=vocab, eos_id=0)
    (tmp_path / "index.json").write_text(json.dumps(index))
    return tmp_path


def test_prepared_windows_run_across_shard_boundaries(tmp_path):
    from hpkit.runtime.loop.data import PreparedTokens

    source = PreparedTokens(_prepared_dir(tmp_path, [7, 3, 0, 11]), seq_len=4, seed=5, vocab_size=1000)
    assert len(source) == 5  # 21 tokens: windows start at 0, 4, 8, 12, 16
    windows = sorted(source.sample(i).tolist() for i in range(5))
    assert windows == [list(range(s, s + 5)) for s in range(0, 20, 4)]
    second_epoch = sorted(source.sample(i).tolist() for i in range(5, 10))
    assert second_epoch == windows


def test_prepared_directory_errors_name_the_field_and_the_fix(tmp_path):
    from hpkit.runtime.loop.data import PreparedTokens

    with pytest.raises(
        SpecError, match=r"train.data.path: .* has no index.json: make one with `hpkit data prepare"
    ):
        PreparedTokens(tmp_path, 4, 0, 1000)
    (tmp_path / ".prepare-state.json").write_text("{}")
    with pytest.raises(SpecError, match="did not finish: run `hpkit data prepare` again"):
        PreparedTokens(tmp_path, 4, 0, 1000)
    prepared = _prepared_dir(tmp_path, [10, 10], vocab=32000)
    with pytest.raises(
        SpecError, match=r"vocabulary of 32000, more than the model.s 1000: set model\.vocab_size"
    ):
        PreparedTokens(prepared, 4, 0, 1000)
    (prepared / "shard-00001.bin").write_bytes(b"\0" * 6)
    with pytest.raises(SpecError, match=r"shard-00001.bin is 6 bytes, the index says 20"):
        PreparedTokens(prepared, 4, 0, 32000)
