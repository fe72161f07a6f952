"""What each worker process does to a chunk: parse it (JSON lines), tokenise, append EOS.

Problems are returned, not raised, so that the main process reports the first one in input order
(whatever worker met it) and decides whether `--skip-bad` lets it pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from hpkit import json_text

MALFORMED = "malformed"  # not a JSON object on one line: --skip-bad may skip it
NO_FIELD = "no_field"
NOT_TEXT = "not_text"

_state: dict = {}


@dataclass
class Encoded:
    ids: np.ndarray  # uint32, every document's tokens (each ending in EOS) back to back
    lengths: np.ndarray  # tokens per item; 0 for an item with a problem
    problems: list[tuple[int, str, str]]  # (item, kind, detail)


def init(tokenizer_json: str, eos_id: int, text_field: str, single_thread: bool) -> None:
    if single_thread:
        # One core per worker: the pool provides the parallelism, and a forked Rust thread pool would not.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _state.update(tok=Tokenizer.from_str(tokenizer_json), eos=eos_id, field=text_field)


def encode(fmt: str, payload: list) -> Encoded:
    texts: list[str] = []
    where: list[int] = []
    problems: list[tuple[int, str, str]] = []
    for i, item in enumerate(payload):
        text, problem = _text_of(fmt, item, _state["field"])
        if problem is not None:
            problems.append((i, *problem))
        else:
            texts.append(text)
            where.append(i)
    lengths = np.zeros(len(payload), dtype=np.int64)
    if not texts:
        return Encoded(np.zeros(0, dtype=np.uint32), lengths, problems)
    eos = _state["eos"]
    docs = []
    for i, enc in zip(where, _state["tok"].encode_batch(texts), strict=True):
        ids = enc.ids
        # A template that already ends documents with EOS (some do) gets no second one.
        if not ids or ids[-1] != eos:
            ids = [*ids, eos]
        lengths[i] = len(ids)
        docs.append(np.asarray(ids, dtype=np.uint32))
    return Encoded(np.concatenate(docs), lengths, problems)


def _text_of(fmt: str, item, field: str) -> tuple[str, tuple[str, str] | None]:
    if fmt != "jsonl":
        if item is None:
            return "", (NOT_TEXT, f"{field!r} is null")
        return item, None
    try:
        obj = json_text.loads(item)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        return "", (MALFORMED, f"not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return "", (MALFORMED, f"a JSON {type(obj).__name__}, not an object")
    if field not in obj:
        fields = ", ".join(list(obj)[:8]) or "none"
        return "", (NO_FIELD, f"no field {field!r} (fields: {fields}): pass --text-field NAME")
    value = obj[field]
    if not isinstance(value, str):
        return "", (NOT_TEXT, f"field {field!r} is {type(value).__name__}, not a string")
    return value, None
