"""`hpkit data prepare --format chat` end to end: rows, flags and index; what training reads back (labels
masked, positions restarting per packed conversation, mid-epoch resume); bad input in one line, nothing left."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_chat_templates import encoder, make_chat_tokenizer

from hpkit.commands import data as data_cmd
from hpkit.data.index import read_index
from hpkit.errors import HpkitError
from hpkit.runtime.loop.data import ChatRows, DataLoader, build_source
from hpkit.runtime.loop.loss import IGNORE_INDEX

SEQ = 48
LINES = [
    {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]},
    {"conversations": [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "4"}]},
    {"prompt": "the capital of France?", "completion": "Paris."},
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "quick brown fox?"},
            {"role": "assistant", "content": "lazy dog."},
        ]
    },
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok") / "llama3", "llama3")


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _prepare(tokenizer: Path, tmp: Path, records: list, *extra: str) -> tuple[int, Path]:
    src = _write(tmp / "chat.jsonl", records * 5)
    out = tmp / "out"
    args = ["prepare", str(src), "--tokenizer", str(tokenizer), "--out", str(out), "--format", "chat"]
    return data_cmd.main([*args, "--seq-len", str(SEQ), *extra]), out


def test_packed_rows_keep_mask_and_boundaries_and_training_reads_them(tokenizer, tmp_path, capsys):
    rc, out = _prepare(tokenizer, tmp_path, LINES, "--shard-tokens", "200")
    assert rc == 0 and "20 conversations" in capsys.readouterr().out
    index = read_index(out)
    assert index.chat["seq_len"] == SEQ and index.chat["packed"] and len(index.shards) > 1
    source = build_source("prepared", str(out), "uint16", SEQ, 3, 512)
    assert isinstance(source, ChatRows)
    enc = encoder(tokenizer)
    examples = [enc.encode(m) for m in [LINES[0]["messages"]]]
    loader = DataLoader(source, local_batch=len(source), dp_rank=0, dp_degree=1)
    inputs, labels, positions = loader.next_batch_with_positions()
    assert positions is not None and inputs.shape == labels.shape == positions.shape == (len(source), SEQ)
    # Every conversation starts at position 0 and is whole in one row: 20 starts, plus padding's.
    starts = int((positions == 0).sum())
    assert 20 <= starts <= 20 + len(source)
    # A counted label is the next token and never the first token of the next conversation.
    counted = labels != IGNORE_INDEX
    assert 0 < int(counted.sum()) < counted.numel() // 2
    next_pos = torch.cat([positions[:, 1:], torch.zeros_like(positions[:, :1])], 1)
    assert not (counted & (next_pos == 0) & (positions != SEQ - 1)).any()
    # The first conversation's counted targets are exactly its assistant tokens ("hello world<|eot_id|>").
    n = len(examples[0].ids)
    row = next(r for r in range(len(source)) if inputs[r, :n].tolist() == examples[0].ids.tolist())
    assert (
        labels[row, : n - 1].tolist() == np.where(examples[0].counts[1:], examples[0].ids[1:], -100).tolist()
    )


def test_a_resumed_loader_continues_mid_epoch_with_the_same_rows(tokenizer, tmp_path):
    _, out = _prepare(tokenizer, tmp_path, LINES)
    source = build_source("prepared", str(out), "uint16", SEQ, 3, 512)
    straight = DataLoader(source, local_batch=1, dp_rank=0, dp_degree=1)
    seen = [straight.next_batch_with_positions() for _ in range(len(source) + 2)]  # into a second epoch
    resumed = DataLoader(build_source("prepared", str(out), "uint16", SEQ, 3, 512), 1, 0, 1)
    resumed.load_state_dict({"position": 2})
    for expected in seen[2:]:
        got = resumed.next_batch_with_positions()
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_unpacked_rows_hold_one_conversation_each(tokenizer, tmp_path):
    rc, out = _prepare(tokenizer, tmp_path, LINES, "--no-pack")
    assert rc == 0
    source = build_source("prepared", str(out), "uint16", SEQ, 3, 512)
    assert len(source) == 20
    _, labels, positions = DataLoader(source, 20, 0, 1).next_batch_with_positions()
    assert positions is None and (labels != IGNORE_INDEX).any(dim=1).all()


def test_a_model_seq_len_other_than_the_prepared_one_is_refused(tokenizer, tmp_path):
    _, out = _prepare(tokenizer, tmp_path, LINES)
    from hpkit.errors import SpecError

    with pytest.raises(SpecError, match=f"prepared for seq_len {SEQ}.*--seq-len 64"):
        build_source("prepared", str(out), "uint16", 64, 3, 512)


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"text": "no conversation here"}, r"chat.jsonl:2: no \"messages\".*its keys: text"),
        ('{"messages": [', r"chat.jsonl:2: not valid JSON"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
            r'chat.jsonl:2: messages\[1\] is not an object with "role" and "content"',
        ),
    ],
)
def test_bad_lines_name_file_and_line_and_leave_nothing(tokenizer, tmp_path, bad, expected):
    src = _write(tmp_path / "chat.jsonl", [LINES[0], bad, LINES[1]])
    out = tmp_path / "out"
    args = ["prepare", str(src), "--tokenizer", str(tokenizer), "--out", str(out), "--format", "chat"]
    with pytest.raises(HpkitError, match=expected) as info:
        data_cmd.main([*args, "--seq-len", str(SEQ)])
    assert "\n" not in str(info.value) and "nothing was written" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]


def test_a_role_the_template_refuses_names_file_and_line(tmp_path):
    tokenizer = make_chat_tokenizer(tmp_path / "mistral", "mistral")
    src = _write(tmp_path / "chat.jsonl", [LINES[0], LINES[3]])  # line 2 has a system turn
    args = [
        "prepare",
        str(src),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(tmp_path / "out"),
        "--format",
        "chat",
    ]
    with pytest.raises(
        HpkitError, match=r"chat.jsonl:2: the chat template refuses it: Conversation roles must"
    ):
        data_cmd.main([*args, "--seq-len", str(SEQ)])
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(tokenizer, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_text((tokenizer / "tokenizer.json").read_text())
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    src = _write(tmp_path / "chat.jsonl", LINES)
    args = [
        "prepare",
        str(src),
        "--tokenizer",
        str(plain),
        "--out",
        str(tmp_path / "out"),
        "--format",
        "chat",
    ]
    with pytest.raises(HpkitError, match=r"tokenizer_config\.json has no chat_template") as info:
        data_cmd.main([*args, "--seq-len", str(SEQ)])
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
