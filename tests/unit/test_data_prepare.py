"""`hpkit data prepare`: shards that decode back to the documents, an index that describes them, output
independent of the worker count, resume rules, and bad input as one line naming file and row."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from data_corpus import EOS, documents, train_tokenizer, write_corpus
from hpkit.cli import main
from hpkit.data.index import STATE_NAME, read_index
from hpkit.data.prepare import Options, prepare

DOCS = documents(150)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok = train_tokenizer(root / "tok", DOCS)
    inputs = write_corpus(root / "in", DOCS)
    return root, tok, [str(p) for p in inputs]


def _prepare(corpus, out: Path, **kw):
    _, tok, inputs = corpus
    opts = {"inputs": inputs, "tokenizer": str(tok), "out": out, "shard_tokens": 700, "workers": 1, **kw}
    return prepare(Options(**opts))


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what earlier calls printed
    code = main(["data", "prepare", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _stream(out: Path) -> np.ndarray:
    index = read_index(out)
    return np.concatenate([np.fromfile(out / s.name, dtype=index.dtype) for s in index.shards])


def _tree(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_decoding_the_shards_gives_back_the_documents_in_order(corpus, tmp_path):
    from tokenizers import Tokenizer

    _root, tok_dir, _ = corpus
    result = _prepare(corpus, tmp_path / "out")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    stream = _stream(tmp_path / "out")
    assert stream.dtype == np.uint16 and stream[-1] == eos
    cuts = np.flatnonzero(stream == eos)
    pieces = np.split(stream, cuts + 1)[:-1]
    decoded = [tok.decode(p[:-1].tolist(), skip_special_tokens=False) for p in pieces]
    assert decoded == DOCS
    assert result.documents == len(DOCS) and result.tokens == len(stream)

    index = json.loads((tmp_path / "out" / "index.json").read_text())
    lengths = [s["tokens"] for s in index["shards"]]
    assert len(lengths) > 5 and set(lengths[:-1]) == {700} and 0 < lengths[-1] <= 700
    assert index["documents"] == len(DOCS) and index["tokens"] == sum(lengths)
    assert index["dtype"] == "uint16" and index["eos_id"] == eos
    assert (
        index["tokenizer"]["sha256"] == hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    )
    for shard in index["shards"]:
        assert hashlib.sha256((tmp_path / "out" / shard["name"]).read_bytes()).hexdigest() == shard["sha256"]
    sources = index["sources"]
    assert [s["format"] for s in sources[:2]] == ["jsonl", "parquet"] and len(sources) == 2 + 50
    assert all(s["bytes"] == Path(s["path"]).stat().st_size for s in sources)
    assert not (tmp_path / "out" / STATE_NAME).exists()


def test_the_output_does_not_depend_on_the_worker_count(corpus, tmp_path):
    _prepare(corpus, tmp_path / "one", workers=1)
    _prepare(corpus, tmp_path / "three", workers=3, chunk_rows=7)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "three")


def test_progress_and_summary_lines(corpus, tmp_path, capsys):
    _, tok, inputs = corpus
    code, out, err = _cli(
        capsys, *inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "o"), "--workers", "1"
    )
    assert code == 0
    assert out.startswith(f"hpkit data: wrote {tmp_path / 'o'}: ") and f"{len(DOCS)} documents" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hpkit data: {len(DOCS)} rows | ") and "tokens/s" in last and "done in" in last
    code, out, _ = _cli(capsys, *inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "o"))
    assert code == 0 and "already prepared" in out


def test_a_resume_refuses_other_settings_naming_what_differs(corpus, tmp_path, capsys):
    _root, tok, inputs = corpus
    out = tmp_path / "out"
    _prepare(corpus, out)
    (out / "index.json").unlink()  # as if stopped before the end: rebuild the state a run leaves
    code, _, err = _cli(capsys, *inputs, "--tokenizer", str(tok), "--out", str(out), "--shard-tokens", "700")
    assert code == 1 and "holds shard files but no index.json" in err

    out2 = tmp_path / "out2"
    _prepare(corpus, out2)
    index = json.loads((out2 / "index.json").read_text())
    manifest = {k: index[k] for k in index if k not in ("shards", "tokens", "documents", "skipped_bad")}
    state = {
        "manifest": manifest,
        "shards": index["shards"][:2],
        "cursor": {"source": 0, "row": 0, "offset": 0, "skip": 0},
        "documents": 0,
        "skipped_bad": 0,
    }
    (out2 / "index.json").unlink()
    (out2 / STATE_NAME).write_text(json.dumps(state))
    code, _, err = _cli(capsys, *inputs, "--tokenizer", str(tok), "--out", str(out2), "--shard-tokens", "800")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "an unfinished preparation with other settings" in err and "shard_tokens was 700, now 800" in err
    code, _, err = _cli(
        capsys, *inputs[:2], "--tokenizer", str(tok), "--out", str(out2), "--shard-tokens", "700"
    )
    assert code == 1 and "0000.txt was an input and is not now" in err


@pytest.mark.parametrize(
    "index_text", ['{"format": "hpkit', "[]", '{"shards": 7}'], ids=["torn", "list", "shape"]
)
def test_an_unreadable_finished_index_is_one_line_and_nothing_is_removed(
    corpus, tmp_path, capsys, index_text
):
    _root, tok, inputs = corpus
    out = tmp_path / "out"
    _prepare(corpus, out)
    (out / "index.json").write_text(index_text)
    before = _tree(out)
    code, _, err = _cli(capsys, *inputs, "--tokenizer", str(tok), "--out", str(out), "--shard-tokens", "700")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "index.json: unreadable" in err and f"remove {out} to start over" in err
    assert _tree(out) == before


def _bad_corpus(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


# A line nested past the JSON parser's recursion limit ended `hpkit data prepare` in a RecursionError traceback.
@pytest.mark.parametrize(
    "broken", ['{"text": "unterminated', '{"text": ' + "[" * 20000 + "]" * 20000 + "}"], ids=["torn", "deep"]
)
def test_a_malformed_json_line_stops_with_file_and_line_and_no_partial_shard(
    corpus, tmp_path, capsys, broken
):
    _, tok, _ = corpus
    good = [json.dumps({"text": d}) for d in DOCS[:40]]
    bad = _bad_corpus(tmp_path, [*good[:30], broken, *good[30:]])
    out = tmp_path / "out"
    code, stdout, err = _cli(
        capsys, bad, "--tokenizer", str(tok), "--out", str(out), "--shard-tokens", "300", "--workers", "1"
    )
    assert code == 1 and stdout == ""
    lines = [line for line in err.splitlines() if " rows | " not in line]  # not progress lines
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hpkit data: error: {bad}:31: not valid JSON")
    assert "--skip-bad" in lines[0]
    shards = sorted(out.glob("shard-*"))
    assert shards and all(p.stat().st_size == 600 for p in shards), "only whole shards"
    assert not list(out.glob("*.tmp")) and not (out / "index.json").exists()

    code, stdout, _ = _cli(
        capsys, bad, "--tokenizer", str(tok), "--out", str(tmp_path / "skip"), "--skip-bad", "--workers", "1"
    )
    assert code == 0 and "1 malformed lines skipped" in stdout
    index = json.loads((tmp_path / "skip" / "index.json").read_text())
    assert index["skipped_bad"] == 1 and index["documents"] == 40


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"body": "x"}', "no field 'text' (fields: body): pass --text-field NAME"),
        ('{"text": 7}', "field 'text' is int, not a string"),
    ],
)
def test_a_missing_or_wrong_text_field_stops_even_with_skip_bad(corpus, tmp_path, capsys, line, message):
    _, tok, _ = corpus
    bad = _bad_corpus(tmp_path, [json.dumps({"text": "fine"}), line])
    code, _, err = _cli(
        capsys, bad, "--tokenizer", str(tok), "--out", str(tmp_path / "o"), "--skip-bad", "--workers", "1"
    )
    assert code == 1 and f"hpkit data: error: {bad}:2: {message}" in err
    assert not list((tmp_path / "o").glob("shard-*"))


def test_parquet_without_the_text_column(corpus, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, tok, _ = corpus
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"content": ["a", "b"]}), path)
    code, _, err = _cli(capsys, str(path), "--tokenizer", str(tok), "--out", str(tmp_path / "o"))
    assert code == 1
    assert (
        err.strip()
        == f"hpkit data: error: {path}: no column 'text' (columns: content): pass --text-field NAME"
    )
    code, _, _ = _cli(
        capsys, str(path), "--text-field", "content", "--tokenizer", str(tok), "--out", str(tmp_path / "o")
    )
    assert code == 0


def _wordlevel(directory: Path, size: int, eos: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 1)}
    vocab["[UNK]"] = size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos:
        tok.add_special_tokens([eos])
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_dtype_follows_the_vocabulary_and_a_forced_one_must_fit(tmp_path, capsys):
    big = _wordlevel(tmp_path / "big", 70_000, "</s>")  # found by its conventional name: no config file
    corpus = _bad_corpus(tmp_path, [json.dumps({"text": "w1 w69000 w5"})])
    code, _, err = _cli(
        capsys, corpus, "--tokenizer", str(big), "--out", str(tmp_path / "o"), "--dtype", "uint16"
    )
    assert code == 1
    assert err.strip() == (
        "hpkit data: error: --dtype uint16: the tokenizer has 70001 tokens, more than uint16 holds (65536): "
        "use --dtype uint32 (or auto)"
    )
    assert _cli(capsys, corpus, "--tokenizer", str(big), "--out", str(tmp_path / "o"))[0] == 0
    index = read_index(tmp_path / "o")
    assert index.dtype == "uint32"
    assert np.fromfile(tmp_path / "o" / "shard-00000.bin", dtype="uint32").tolist() == [1, 69000, 5, 70000]


def test_a_tokenizer_without_eos_is_refused_unless_one_is_named(tmp_path, capsys):
    tok = _wordlevel(tmp_path / "tok", 10, "[END]")
    corpus = _bad_corpus(tmp_path, [json.dumps({"text": "w1 w2"})])
    code, _, err = _cli(capsys, corpus, "--tokenizer", str(tok), "--out", str(tmp_path / "o"))
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "names no EOS token" in err and "pass --eos-token TOKEN" in err
    assert (
        _cli(capsys, corpus, "--tokenizer", str(tok), "--out", str(tmp_path / "o"), "--eos-token", "[END]")[0]
        == 0
    )
    assert read_index(tmp_path / "o").eos_id == 10


def test_a_hub_name_says_no_hub_is_reachable_and_what_to_do(tmp_path, capsys):
    corpus = _bad_corpus(tmp_path, [json.dumps({"text": "x"})])
    code, _, err = _cli(
        capsys, corpus, "--tokenizer", "meta-llama/Llama-3.1-8B", "--out", str(tmp_path / "o")
    )
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "no model hub is reachable from here" in err
    assert (
        "huggingface-cli download meta-llama/Llama-3.1-8B --local-dir DIR" in err and "--tokenizer DIR" in err
    )


def test_inputs_that_match_nothing_or_have_an_unknown_format(tmp_path, capsys):
    tok = _wordlevel(tmp_path / "tok", 10, "</s>")
    code, _, err = _cli(
        capsys, str(tmp_path / "*.jsonl"), "--tokenizer", str(tok), "--out", str(tmp_path / "o")
    )
    assert code == 1 and "no file matches this pattern" in err
    (tmp_path / "data.csv").write_text("a,b\n")
    code, _, err = _cli(
        capsys, str(tmp_path / "data.csv"), "--tokenizer", str(tok), "--out", str(tmp_path / "o")
    )
    assert code == 1 and "unknown format .csv" in err


class _Stop(Exception):
    pass


def test_a_stop_after_any_shard_resumes_to_the_same_output_in_each_format(corpus, tmp_path, monkeypatch):
    from hpkit.data.shards import ShardWriter

    reference = tmp_path / "reference"
    total = len(_prepare(corpus, reference, shard_tokens=300).shards)
    real_cut = ShardWriter.cut
    sources_seen = set()
    for stop_at in (total // 6, total // 2, 5 * total // 6):
        out = tmp_path / f"stop-{stop_at}"

        def cut(self, stop_at=stop_at):
            if self.number == stop_at:
                raise _Stop  # as if killed before this shard's file appeared
            return real_cut(self)

        monkeypatch.setattr(ShardWriter, "cut", cut)
        with pytest.raises(_Stop):
            _prepare(corpus, out, shard_tokens=300)
        monkeypatch.setattr(ShardWriter, "cut", real_cut)
        state = json.loads((out / STATE_NAME).read_text())
        assert len(state["shards"]) == stop_at
        sources_seen.add(min(state["cursor"]["source"], 2))
        result = _prepare(corpus, out, shard_tokens=300, workers=2 if stop_at == total // 2 else 1)
        assert result.resumed_shards == stop_at
        assert _tree(out) == _tree(reference)
    assert sources_seen == {0, 1, 2}, "resumed inside the JSONL file, the Parquet file and the text files"
