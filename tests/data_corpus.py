"""A small corpus and a tokenizer trained on it in the test (no download): shared by the data tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
WORDS = [
    "river",
    "stone",
    "lantern",
    "orbit",
    "maple",
    "quartz",
    "ember",
    "tundra",
    "velvet",
    "cobalt",
    "harbor",
    "prism",
    "nimbus",
    "fable",
]


def documents(count: int, seed: int = 0) -> list[str]:
    """Varied text: short and long, punctuation, newlines and non-ASCII, so byte-level decoding is tested."""
    rng = random.Random(seed)
    docs = []
    for n in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 80))]
        if n % 7 == 3:
            words.insert(rng.randint(0, len(words)), "\n\nnaïve café — 東京")
        docs.append(" ".join(words) + rng.choice([".", "!", "?", ""]))
    return docs


def train_tokenizer(directory: Path, docs: list[str], vocab: int = 400, config: bool = True) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return directory


def write_corpus(directory: Path, docs: list[str]) -> list[Path]:
    """The documents split over a JSONL file, a Parquet file (several row groups) and text files, in that order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    third = len(docs) // 3
    jsonl = directory / "a.jsonl"
    with jsonl.open("w", encoding="utf-8") as f:
        for i, doc in enumerate(docs[:third]):
            f.write(json.dumps({"id": i, "text": doc}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 5:
                f.write("\n")  # a blank line is not a document
    parquet = directory / "b.parquet"
    pq.write_table(pa.table({"text": docs[third : 2 * third]}), parquet, row_group_size=max(1, third // 4))
    texts = directory / "c"
    texts.mkdir(exist_ok=True)
    for i, doc in enumerate(docs[2 * third :]):
        (texts / f"{i:04d}.txt").write_text(doc, encoding="utf-8")
    return [jsonl, parquet, texts / "*.txt"]
