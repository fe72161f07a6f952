"""Chat templates rendered as transformers renders them, and the assistant masks drawn from them.

The templates are real ones, copied from public tokenizer_config.json files (tests/fixtures/chat: Llama 3,
Mistral, ChatML/Qwen 2, plus ChatML with `{% generation %}` tags); the tokenizer is a tiny byte-level BPE
built here with each family's special tokens. The reference is transformers' apply_chat_template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hpkit.data.chat import ChatEncoder, messages_of
from hpkit.data.chat_template import load_template
from hpkit.errors import HpkitError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat"
FAMILIES = ("llama3", "mistral", "qwen2")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is.",
    "You are a helpful assistant. Answer briefly: 2 + 2 = 4. Thanks! Bonjour, ça va? système",
    "system user assistant INST [/INST] hello world numbers 0123456789 () {} [] <> # - _ , ; : !",
]
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "  And 2 + 2?  "},
        {"role": "assistant", "content": "4, ça va!"},
    ],
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello world"},
    ],
]


def make_chat_tokenizer(out: Path, family: str) -> Path:
    """A directory with tokenizer.json and tokenizer_config.json (the family's template and tokens)."""
    spec = json.loads((FIXTURES / f"{family}.json").read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=spec["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {k: v for k, v in spec.items() if k not in ("_source", "special_tokens")}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def encoder(directory: Path, train_on: str = "assistant") -> ChatEncoder:
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    special = [t["content"] for t in json.loads((directory / "tokenizer.json").read_text())["added_tokens"]]
    return ChatEncoder(load_template(directory), tok, train_on, special)


def _hf(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _ids(value) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list
    return list(value["input_ids"]) if hasattr(value, "keys") else list(value)


@pytest.mark.parametrize("family", [*FAMILIES, "chatml_generation"])
def test_rendering_equals_transformers_token_for_token(tmp_path, family):
    directory = make_chat_tokenizer(tmp_path / family, family)
    hf, enc = _hf(directory), encoder(directory)
    for conversation in CONVERSATIONS:
        if family == "mistral":  # Mistral refuses a system turn (tested below)
            conversation = [m for m in conversation if m["role"] != "system"]
        ours = enc.encode(conversation).ids.tolist()
        assert ours == _ids(hf.apply_chat_template(conversation, tokenize=True)), family
        assert len(ours) > 10


def _counted_text(directory: Path, example) -> list[str]:
    """The counted tokens, decoded run by run."""
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    runs, current = [], []
    for token, counts in zip(example.ids.tolist(), example.counts.tolist(), strict=True):
        if counts:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


EXPECTED_RUNS = {
    "llama3": ["Paris.<|eot_id|>", "4, ça va!<|eot_id|>"],
    "mistral": ["Paris.</s>", "4, ça va!</s>"],
    "qwen2": ["Paris.<|im_end|>", "4, ça va!<|im_end|>"],
    "chatml_generation": ["Paris.<|im_end|>", "4, ça va!<|im_end|>"],
}


@pytest.mark.parametrize("family", [*FAMILIES, "chatml_generation"])
def test_assistant_turns_count_content_and_end_of_turn_never_the_header(tmp_path, family):
    directory = make_chat_tokenizer(tmp_path / family, family)
    conversation = [m for m in CONVERSATIONS[0] if family != "mistral" or m["role"] != "system"]
    assert _counted_text(directory, encoder(directory).encode(conversation)) == EXPECTED_RUNS[family]
    assert (
        _counted_text(directory, encoder(directory, "last").encode(conversation))
        == EXPECTED_RUNS[family][-1:]
    )
    everything = encoder(directory, "all").encode(conversation)
    assert not everything.counts[0] and everything.counts[1:].all()


def test_generation_tags_give_transformers_assistant_mask(tmp_path):
    directory = make_chat_tokenizer(tmp_path / "g", "chatml_generation")
    hf = _hf(directory)
    for conversation in CONVERSATIONS:
        ref = hf.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ours = encoder(directory).encode(conversation)
        expected = np.asarray(ref["assistant_masks"], dtype=bool)
        expected[0] = False
        assert ours.counts.tolist() == expected.tolist()


def test_a_template_reaching_outside_the_sandbox_is_refused_in_one_line(tmp_path):
    directory = make_chat_tokenizer(tmp_path / "evil", "qwen2")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(HpkitError) as info:
        encoder(directory).encode(CONVERSATIONS[1])
    message = str(info.value)
    assert "\n" not in message and "sandbox" in message and "tokenizer_config.json" in message


def test_a_role_the_template_refuses_names_the_reason(tmp_path):
    directory = make_chat_tokenizer(tmp_path / "m", "mistral")
    from hpkit.data.chat import BadExample

    with pytest.raises(BadExample, match="Only user and assistant roles are supported"):
        encoder(directory).encode([{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}])


def test_common_input_shapes_become_messages():
    assert messages_of(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    ) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert messages_of({"prompt": "q", "completion": "a"}) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
