"""The tokenizer: a Hugging Face fast tokenizer (`tokenizer.json`) from a local directory, with its EOS token.

Workers rebuild it from the JSON text, so every process tokenises with exactly the bytes that were hashed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from hpkit import json_text
from hpkit.errors import HpkitError

# Tried, in order, when no tokenizer_config.json / special_tokens_map.json names the EOS token.
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    json_text: str
    sha256: str
    vocab_size: int
    eos_token: str
    eos_id: int


def load(where: str, eos_token: str | None = None) -> TokenizerInfo:
    from tokenizers import Tokenizer

    directory = Path(where)
    if not directory.exists():
        if _looks_like_hub_name(where):
            raise HpkitError(
                f"--tokenizer {where}: no such directory, and no model hub is reachable from here: download it "
                f"where one is (huggingface-cli download {where} --local-dir DIR) and pass --tokenizer DIR"
            )
        raise HpkitError(f"--tokenizer {where}: no such directory")
    file = directory / "tokenizer.json" if directory.is_dir() else directory
    if not file.is_file():
        raise HpkitError(
            f"--tokenizer {where}: no tokenizer.json there: save a fast tokenizer into it "
            "(transformers: AutoTokenizer.from_pretrained(...).save_pretrained(DIR))"
        )
    text = file.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise HpkitError(f"--tokenizer {where}: {file} is not a tokenizers file ({exc})") from None
    config = _read_json(file.parent / "tokenizer_config.json")
    name = str(config.get("name_or_path") or file.parent.resolve().name)
    chosen = eos_token or _configured_eos(file.parent) or _known_eos(tok)
    if chosen is None:
        raise HpkitError(
            f"--tokenizer {where}: the tokenizer names no EOS token (tokenizer_config.json eos_token) and "
            f"has none of {', '.join(KNOWN_EOS)}: pass --eos-token TOKEN"
        )
    eos_id = tok.token_to_id(chosen)
    if eos_id is None:
        raise HpkitError(f"--eos-token {chosen}: the tokenizer has no such token: name one of its tokens")
    return TokenizerInfo(
        name=name,
        json_text=text,
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token=chosen,
        eos_id=eos_id,
    )


def _looks_like_hub_name(where: str) -> bool:
    parts = where.split("/")
    return len(parts) == 2 and all(parts) and not where.startswith((".", "~"))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json_text.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise HpkitError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    # transformers writes a special token as a string or as {"content": ..., ...} (an AddedToken).
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _configured_eos(directory: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        found = _token_text(_read_json(directory / name).get("eos_token"))
        if found:
            return found
    return None


def _known_eos(tok) -> str | None:
    return next((t for t in KNOWN_EOS if tok.token_to_id(t) is not None), None)
