"""Conversations -> token ids plus a loss mask, rendered with the model's own chat template.

Input lines (JSONL), in any of the common shapes:
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
  {"conversations": [{"from": "human"|"gpt"|"system"|..., "value": ...}, ...]}   (ShareGPT)
  {"prompt": ..., "completion": ...}                                              (one user turn, one answer)

Which tokens count in the loss (`train_on`): `assistant` every assistant turn, `last` the last one, `all`
every token. An assistant turn counts its content and its end-of-turn token, never its header: with a
`{% generation %}` tag in the template, exactly the tag's output (as transformers' assistant mask); without
one, what rendering the turn adds after the conversation so far with the generation prompt, i.e. everything
after the header, up to and including its last special token (a newline the template writes after the
end-of-turn token belongs to no one's answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpkit import json_text
from hpkit.data.chat_template import ChatTemplate, TemplateRefused
from hpkit.errors import HpkitError

TRAIN_ON = ("assistant", "all", "last")
# ShareGPT speakers -> chat roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
SHAREGPT_ROLES |= {"chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "tool": "tool"}


class BadExample(HpkitError):
    """A line that is not a conversation the template can render; the caller prefixes file:line."""


@dataclass
class Example:
    ids: np.ndarray  # int64 token ids of the rendered conversation
    counts: np.ndarray  # bool: token j is a target of the loss (predicted from token j-1)


def messages_of(record: Any) -> list[dict[str, Any]]:
    """The conversation of one JSONL record, as [{role, content}], in whichever shape the line has."""
    if not isinstance(record, dict):
        raise BadExample('not a JSON object: write one {"messages": [...]} object per line')
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadExample('"messages" is not a non-empty list of {"role", "content"} objects')
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise BadExample(f'messages[{i}] is not an object with "role" and "content"')
        # transformers drops keys whose value is null before rendering
        return [{k: v for k, v in m.items() if v is not None} for m in messages]
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise BadExample('"conversations" is not a non-empty list of {"from", "value"} objects')
        out = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("from"), str) or "value" not in t:
                raise BadExample(f'conversations[{i}] is not an object with "from" and "value"')
            role = SHAREGPT_ROLES.get(t["from"].lower())
            if role is None:
                raise BadExample(
                    f'conversations[{i}]: unknown speaker "from": {t["from"]!r} '
                    f"(known: {', '.join(sorted(SHAREGPT_ROLES))})"
                )
            out.append({"role": role, "content": t["value"]})
        return out
    if "prompt" in record and "completion" in record:
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    keys = ", ".join(sorted(record)) or "none"
    raise BadExample(f'no "messages" (nor "conversations", nor "prompt" and "completion"); its keys: {keys}')


class ChatEncoder:
    """Renders and tokenises conversations; `special_tokens` are the tokenizer's special added tokens."""

    def __init__(
        self, template: ChatTemplate, tokenizer: Any, train_on: str, special_tokens: list[str]
    ) -> None:
        if train_on not in TRAIN_ON:
            raise HpkitError(f"--train-on {train_on}: choose one of {', '.join(TRAIN_ON)}")
        self.template, self.tok, self.train_on = template, tokenizer, train_on
        self.special = sorted(special_tokens, key=len, reverse=True)

    def encode(self, messages: list[dict[str, Any]]) -> Example:
        text, spans = self.render(messages)
        return self.example(self.tok.encode(text, add_special_tokens=False), spans)

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans that count (BadExample if the template refuses)."""
        try:
            rendered = self.template.render(messages)
            return rendered.text, self._spans(messages, rendered.text, rendered.generation)
        except TemplateRefused as exc:
            raise BadExample(str(exc)) from None

    def example(self, enc: Any, spans: list[tuple[int, int]]) -> Example:
        """The example from the rendered text's encoding (tokenizers' Encoding: ids, offsets)."""
        ids = np.asarray(enc.ids, dtype=np.int64)
        counts = np.zeros(len(ids), dtype=bool)
        if self.train_on == "all":
            counts[:] = True
        elif spans:
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            for a, b in spans:  # a token counts if its characters overlap the span
                counts |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
        if len(counts):
            counts[0] = False  # the first token has nothing before it to predict it from
        return Example(ids, counts)

    def _spans(self, messages: list[dict[str, Any]], text: str, generation: list[tuple[int, int]]):
        if self.train_on == "all":
            return []
        if self.template.has_generation:
            return generation[-1:] if self.train_on == "last" else generation
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if self.train_on == "last":
            turns = turns[-1:]
        spans = []
        for i in turns:
            header = self.template.render(messages[:i], add_generation_prompt=True).text if i else ""
            upto = self.template.render(messages[: i + 1]).text
            if not (text.startswith(upto) and upto.startswith(header)):
                raise BadExample(
                    f"messages[{i}]: the template does not render this conversation turn by turn (a turn "
                    "changes what came before it), so its assistant tokens cannot be found: add "
                    "{% generation %} tags around the assistant's output in the template, or use --train-on all"
                )
            spans.append((len(header), self._end_of_turn(upto, len(header))))
        return spans

    def _end_of_turn(self, upto: str, start: int) -> int:
        """The turn's end: after its last special token when only whitespace follows that token."""
        end = len(upto)
        last = max(
            (upto.rfind(t, start) + len(t) for t in self.special if upto.rfind(t, start) >= 0), default=-1
        )
        return last if last > start and not upto[last:end].strip() else end


@dataclass
class PackStats:
    examples: int = 0
    rows: int = 0
    truncated: int = 0
    counted: int = 0  # target tokens (label counts)
    tokens: int = 0  # tokens of examples (no padding)


class Packer:
    """Rows of `seq_len + 1` tokens (inputs are a row's first seq_len, labels its last seq_len), with a flag
    byte per token: COUNT (a target of the loss) and START (a document starts here). Packed: whole examples
    one after the other while they fit; else one example per row. The rest of a row is padding, a document
    of its own that counts nothing. An example longer than a row is cut to a row (and counted as truncated).
    """

    COUNT, START = 1, 2

    def __init__(self, seq_len: int, pack: bool, pad_id: int) -> None:
        self.width, self.pack, self.pad_id = seq_len + 1, pack, pad_id
        self.stats = PackStats()
        self._ids: list[np.ndarray] = []
        self._flags: list[np.ndarray] = []
        self._fill = 0

    def add(self, example: Example) -> list[tuple[np.ndarray, np.ndarray]]:
        """Adds one example; returns the rows it completed."""
        ids, counts = example.ids, example.counts
        if len(ids) == 0:
            return []
        if len(ids) > self.width:
            ids, counts = ids[: self.width], counts[: self.width]
            self.stats.truncated += 1
        done = []
        if self._fill and (not self.pack or self._fill + len(ids) > self.width):
            done.append(self._close())
        flags = np.where(counts, self.COUNT, 0).astype(np.uint8)
        flags[0] |= self.START
        self._ids.append(ids)
        self._flags.append(flags)
        self._fill += len(ids)
        self.stats.examples += 1
        self.stats.counted += int(counts.sum())
        self.stats.tokens += len(ids)
        return done

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self._close()] if self._fill else []

    def _close(self) -> tuple[np.ndarray, np.ndarray]:
        pad = self.width - self._fill
        ids = np.concatenate([*self._ids, np.full(pad, self.pad_id, dtype=np.int64)])
        pad_flags = np.zeros(pad, dtype=np.uint8)
        if pad:
            pad_flags[0] = self.START
        flags = np.concatenate([*self._flags, pad_flags])
        self._ids, self._flags, self._fill = [], [], 0
        self.stats.rows += 1
        return ids, flags


def row_labels_positions(rows: np.ndarray, flags: np.ndarray, ignore_index: int):
    """(inputs, labels, positions) of rows [n, seq_len+1] and their flags: a label counts where its token
    is a target and does not start a document; positions restart at 0 at each document's start."""
    inputs, targets, tflags = rows[:, :-1], rows[:, 1:], flags[:, 1:]
    keep = (tflags & Packer.COUNT).astype(bool) & ~(tflags & Packer.START).astype(bool)
    labels = np.where(keep, targets, ignore_index)
    starts = (flags[:, :-1] & Packer.START).astype(bool)
    starts[:, 0] = True
    index = np.arange(inputs.shape[1])[None, :]
    begin = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return inputs, labels, index - begin


def load_record(line: str) -> Any:
    try:
        return json_text.loads(line)
    except ValueError as exc:
        raise BadExample(f"not valid JSON ({exc})") from None
