"""`hpkit data prepare` throughput: tokens/s (and per worker) against a plain single-process
`tokenizer.encode_batch` loop over the same JSONL lines, side by side in one run.

The corpus (generated text) and a BPE tokenizer trained on it are made first; then, in alternating rounds so
that a noisy machine slows every side alike, each side runs in a fresh process:
  - baseline:      read lines, json.loads, encode_batch in batches of 1,000 (tokenizers' own threads on);
  - baseline-1t:   the same with TOKENIZERS_PARALLELISM=false (one core: the per-worker reference);
  - prepare-wN:    `hpkit data prepare --workers N` (whole run: reading, tokenising, shards, fsync, index);
  - chat:          `hpkit data prepare --format chat` over the same documents, each split into a 4-turn
                   conversation (user/assistant) rendered with Qwen 2's ChatML template, assistant-only mask,
                   packed into rows of 2048 (one process: rendering, tokenising, masks, packing, shards, index).
Tokens are counted alike on the token sides (each document's ids plus one EOS); the chat side counts the
rendered conversations' tokens (the template adds its headers), so its ratio is of tokens/s.

    python3 bench/bench_data_prepare.py [--docs 20000] [--workers 1,2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

WORDS = [
    "the", "of", "and", "model", "training", "cluster", "gradient", "shard", "token", "node", "checkpoint",
    "parallel", "tensor", "pipeline", "rank", "memory", "throughput", "latency", "batch", "sequence",
]  # fmt: skip


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpkit-bench-data"))
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--workers", default="1,2", help="worker counts to measure, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    return p.parse_args()


CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>"
    "assistant\\n' }}{% endif %}"
)  # Qwen/Qwen2-7B-Instruct's tokenizer_config.json chat_template


def _conversation(text: str) -> dict:
    words = text.split()
    q = len(words) // 4 or 1
    parts = [" ".join(words[i * q : (i + 1) * q if i < 3 else None]) for i in range(4)]
    roles = ["user", "assistant", "user", "assistant"]
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, parts, strict=True)]}


def _make(root: Path, docs: int) -> tuple[Path, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    corpus = root / "corpus.jsonl"
    texts = []
    with corpus.open("w") as f, (root / "chat.jsonl").open("w") as chat:
        for i in range(docs):
            words = [
                rng.choice(WORDS) + (rng.choice(["", "s", "ed", "ing"]) if i % 3 else "")
                for _ in range(rng.randint(20, 400))
            ]
            text = " ".join(words) + "."
            texts.append(text)
            f.write(json.dumps({"text": text}) + "\n")
            chat.write(json.dumps(_conversation(text)) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts[:2000], trainer)
    (root / "tok").mkdir(exist_ok=True)
    tok.save(str(root / "tok" / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    return corpus, root / "tok"


def _baseline(corpus: Path, tok_dir: Path) -> tuple[int, float]:
    from tokenizers import Tokenizer

    start = time.perf_counter()
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tokens, batch = 0, []
    with corpus.open("rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1000:
                tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(batch))
                batch = []
    if batch:
        tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(batch))
    return tokens, time.perf_counter() - start


def _side(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    corpus, tok_dir = root / "corpus.jsonl", root / "tok"
    if args.side.startswith("baseline"):
        tokens, seconds = _baseline(corpus, tok_dir)
    elif args.side == "chat":
        from hpkit.data.chat_prepare import ChatOptions, prepare_chat

        out = root / "out-chat"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        result = prepare_chat(ChatOptions([str(root / "chat.jsonl")], str(tok_dir), out, seq_len=2047,
                                          shard_tokens=1 << 20))  # fmt: skip
        tokens, seconds = result.stats.tokens, time.perf_counter() - start
    else:
        from hpkit.data.prepare import Options, prepare

        workers = int(args.side.removeprefix("prepare-w"))
        out = root / f"out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        result = prepare(Options([str(corpus)], str(tok_dir), out, workers=workers, shard_tokens=1 << 20,
                                 progress_every_s=1e9))  # fmt: skip
        tokens, seconds = result.tokens, time.perf_counter() - start
    print(json.dumps({"tokens": tokens, "seconds": seconds}))


def _run_side(args: argparse.Namespace, side: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    if side == "baseline-1t":
        env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = [sys.executable, __file__, "--dir", args.dir, "--side", side]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    args = _parse()
    if args.side:
        _side(args)
        return 0
    corpus, _ = _make(Path(args.dir), args.docs)
    workers = [int(w) for w in args.workers.split(",")]
    sides = ["baseline", "baseline-1t", *(f"prepare-w{w}" for w in workers), "chat"]
    rates: dict[str, list[float]] = {s: [] for s in sides}
    counts: dict[str, int] = {}
    for _ in range(args.rounds):
        for side in sides:
            r = _run_side(args, side)
            rates[side].append(r["tokens"] / r["seconds"])
            counts[side] = r["tokens"]
    token_sides = {k: v for k, v in counts.items() if k != "chat"}
    assert len(set(token_sides.values())) == 1, f"the sides counted different tokens: {counts}"
    print(f"corpus: {args.docs} documents, {corpus.stat().st_size / 2**20:.1f} MiB, {counts['baseline']} tokens; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; chat: {counts['chat']} rendered tokens")  # fmt: skip
    base, base1 = statistics.median(rates["baseline"]), statistics.median(rates["baseline-1t"])
    for side in sides:
        med = statistics.median(rates[side])
        n = int(side.removeprefix("prepare-w")) if side.startswith("prepare-w") else 1
        raw = ", ".join(f"{r:,.0f}" for r in rates[side])
        print(f"{side:12s} {med:12,.0f} tokens/s  {med / n:12,.0f} per worker  [{raw}]")
    for w in workers:
        med = statistics.median(rates[f"prepare-w{w}"])
        print(f"RATIO data_prepare_w{w}/encode_batch = {med / base:.3f}")
        print(f"RATIO data_prepare_w{w}_per_worker/encode_batch_1thread = {med / w / base1:.3f}")
    chat, w1 = statistics.median(rates["chat"]), statistics.median(rates[f"prepare-w{workers[0]}"])
    print(f"RATIO data_prepare_chat/data_prepare_w{workers[0]} = {chat / w1:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
