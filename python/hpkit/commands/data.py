"""`hpkit data prepare INPUT... --tokenizer DIR --out DIR`: tokenise text into shards that training memory-maps."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpkit.errors import HpkitError

DEFAULT_SHARD_TOKENS = 100_000_000  # hpkit.data.prepare's default; here to answer --help without the extra


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Prepare token data for `hpkit train`.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser(
        "prepare",
        help="tokenise JSONL / Parquet / text files into token shards plus index.json",
        description=(
            "Tokenise JSONL (one object per line), Parquet (one row per document) and text files (one "
            "document per file) into fixed-size shards of token ids, each document followed by EOS. "
            "An interrupted run resumes from its last whole shard when run again with the same arguments."
        ),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or globs (quote globs: 'data/*.jsonl')")
    p.add_argument("--tokenizer", required=True, help="a local directory with tokenizer.json")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--text-field", default="text", help="JSON field / Parquet column of the text (text)")
    p.add_argument("--workers", type=int, default=None, help="tokenising processes (default: the CPUs)")
    p.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard (%(default)s)"
    )
    p.add_argument("--skip-bad", action="store_true", help="skip malformed JSON lines (and count them)")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto", help="token id type")
    p.add_argument("--eos-token", help="the token that ends documents (default: the tokenizer's EOS)")
    chat = p.add_argument_group(
        "chat (--format chat)",
        "JSONL conversations ({messages: [{role, content}]}, {conversations: [{from, value}]} or {prompt, "
        "completion}) rendered with the tokenizer's chat_template, a loss mask beside the tokens",
    )
    chat.add_argument("--format", choices=["text", "chat"], default="text", help="input kind (%(default)s)")
    chat.add_argument(
        "--seq-len", type=int, help="the model's model.seq_len: rows are that long (chat: required)"
    )
    chat.add_argument(
        "--train-on",
        choices=["assistant", "all", "last"],
        default="assistant",
        help="tokens the loss counts: every assistant turn, every token, or the last assistant turn (%(default)s)",
    )
    chat.add_argument(
        "--no-pack",
        action="store_true",
        help="one conversation per row, padded (default: packed, attention kept apart)",
    )
    return parser


def parse_args(argv: list[str], prog: str = "hpkit data") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(prog).parse_args(argv[1:] if argv and argv[0] == "data" else argv)


def main(argv: list[str], prog: str = "hpkit data") -> int:
    args = parse_args(argv, prog)
    if args.format == "chat":
        return _chat(args)
    try:
        from hpkit.data.prepare import Options, prepare
        from hpkit.data.sources import cpu_count
    except ImportError as exc:
        raise HpkitError(f"{exc.name} is not installed: pip install 'hpkit[data]'") from None
    opts = Options(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        out=args.out,
        text_field=args.text_field,
        workers=args.workers if args.workers is not None else cpu_count(),
        shard_tokens=args.shard_tokens,
        skip_bad=args.skip_bad,
        dtype=args.dtype,
        eos_token=args.eos_token,
    )
    result = prepare(opts)
    if result.already_done:
        print(f"hpkit data: {result.out} is already prepared from these inputs ({len(result.shards)} shards)")
        return 0
    resumed = f", resumed after {result.resumed_shards} shards" if result.resumed_shards else ""
    skipped = f", {result.skipped_bad} malformed lines skipped" if result.skipped_bad else ""
    print(
        f"hpkit data: wrote {result.out}: {result.tokens} tokens in {len(result.shards)} shards, "
        f"{result.documents} documents{skipped}{resumed}"
    )
    return 0


def _chat(args: argparse.Namespace) -> int:
    if args.seq_len is None:
        raise HpkitError("--format chat needs --seq-len: the model.seq_len you will train with")
    if args.skip_bad:
        raise HpkitError("--skip-bad is for text data: with --format chat fix or remove the lines it names")
    try:
        from hpkit.data.chat_prepare import ChatOptions, prepare_chat
    except ImportError as exc:
        raise HpkitError(f"{exc.name} is not installed: pip install 'hpkit[data]'") from None
    opts = ChatOptions(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        out=args.out,
        seq_len=args.seq_len,
        train_on=args.train_on,
        pack=not args.no_pack,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
    )
    result = prepare_chat(opts)
    st = result.stats
    if result.already_done:
        print(f"hpkit data: {result.out} is already prepared from these inputs ({st.examples} conversations)")
        return 0
    cut = f", {st.truncated} cut to seq_len+1 tokens" if st.truncated else ""
    print(
        f"hpkit data: wrote {result.out}: {st.examples} conversations in {st.rows} rows of {args.seq_len + 1} "
        f"tokens ({'packed' if opts.pack else 'padded'}), {st.counted} of {st.tokens} tokens count in the "
        f"loss (--train-on {args.train_on}){cut}"
    )
    return 0
