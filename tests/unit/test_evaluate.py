"""Validation's pure parts: the token-weighted mean, which batch each data-parallel rank runs, the held-out
set's batches (the padding of a short last batch and an empty batch count nothing), the config's one-line
errors, and where a result goes (metrics record, step line, TensorBoard-free JSONL, Prometheus, plot); and
the evaluator itself over two FSDP ranks in real gloo processes, one of them with an empty last batch.
Every layout: tests/integration/test_validation.py."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _gloo import run_ranks
from prometheus_client.parser import text_string_to_metric_families

from hpkit.errors import SpecError
from hpkit.metrics.file import read_metrics
from hpkit.metrics.records import EvalEvent, parse_record
from hpkit.runtime.config import EvalSpec, PrometheusSpec, RunConfig
from hpkit.runtime.env import DeviceInfo
from hpkit.runtime.loop.evaluate import EvalSet, Evaluator, rank_rounds, token_weighted_mean
from hpkit.runtime.loop.loss import IGNORE_INDEX
from hpkit.runtime.observe.metrics import MetricsLogger, StepStats
from hpkit.runtime.observe.prometheus import PrometheusExporter
from hpkit.validation import parse_document

SEQ = 8


def test_the_mean_is_over_tokens_not_over_batches():
    # Batch A: 2 tokens of loss 1; batch B: 6 tokens of loss 3 (a short answer and a long one).
    batches = [(2 * 1.0, 2), (6 * 3.0, 6)]
    loss, ppl = token_weighted_mean(sum(s for s, _ in batches), sum(c for _, c in batches))
    assert loss == pytest.approx(20 / 8)  # 2.5
    assert loss != pytest.approx(sum(s / c for s, c in batches) / len(batches))  # 2.0, the wrong mean
    assert ppl == pytest.approx(math.exp(2.5))
    assert token_weighted_mean(1e6, 1)[1] == math.inf  # no overflow error
    with pytest.raises(ValueError):
        token_weighted_mean(0.0, 0)


def test_seven_batches_over_two_ranks_run_four_rounds_each_and_cover_each_batch_once():
    rank0, rank1 = rank_rounds(7, 0, 2), rank_rounds(7, 1, 2)
    assert rank0 == [0, 2, 4, 6]
    assert rank1 == [1, 3, 5, None], "rank 1 runs an empty batch in the last round, not nothing"
    assert sorted(b for b in rank0 + rank1 if b is not None) == list(range(7))
    assert rank_rounds(8, 1, 4) == [1, 5]
    assert rank_rounds(1, 3, 4) == [None]


def _token_file(tmp_path, windows: int):
    path = tmp_path / "val.bin"
    np.arange(windows * SEQ + 1, dtype=np.uint16).__mod__(50).astype(np.uint16).tofile(path)
    return path


def test_held_out_batches_pad_the_last_and_an_empty_batch_counts_nothing(tmp_path):
    spec = EvalSpec(every=1, data={"kind": "tokens", "path": str(_token_file(tmp_path, 13))})
    s = EvalSet(spec, SEQ, seed=0, vocab_size=64, local_batch=2)
    assert s.n_batches(2) == 7 and s.n_batches(1) == 7
    seen = []
    for b in range(7):
        inputs, labels, positions = s.batch(b)
        assert positions is None  # token data: one causal sequence per row
        assert inputs.shape == labels.shape == (2, SEQ)
        counted = labels[(labels != IGNORE_INDEX).all(1)]
        seen += [tuple(row.tolist()) for row in counted]
    assert len(seen) == 13 and len(set(seen)) == 13, (
        "every window once, the padding row of batch 6 not counted"
    )
    last = s.batch(6)[1]
    assert (last[1] == IGNORE_INDEX).all() and (last[0] != IGNORE_INDEX).all()
    inputs, labels, _ = s.batch(None)
    assert inputs.shape == (2, SEQ) and (labels == IGNORE_INDEX).all()
    limited = EvalSet(EvalSpec(every=1, steps=2, data=spec.data), SEQ, 0, 64, local_batch=2)
    assert limited.n_batches(2) == 4 and limited.n_batches(8) == 7


def _validate_over_two_fsdp_ranks(rank: int, world: int, held_out: str) -> None:
    from hpkit.runtime.loop.trainer import Trainer

    model = {"name": "debug", "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_dim": 48, "vocab_size": 64}
    cfg = parse_document(
        RunConfig,
        {
            "model": {**model, "seq_len": SEQ},
            "parallelism": {"dp_shard": world},
            "train": {"steps": 1, "local_batch_size": 2, "mixed_precision": "fp32", "tensorboard": False},
            "eval": {"every": 1, "data": {"kind": "tokens", "path": held_out}},
            "resilience": {"hang": {"enabled": False}},
        },
    )
    trainer = Trainer(cfg, DeviceInfo("cpu", None, "gloo", "cpu"))
    forwards: list[int] = []
    trainer.module.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape[0]))
    result = Evaluator(trainer, cfg.eval).run()
    # 13 windows in batches of 2: rank 0 runs batches 0, 2, 4, 6 and rank 1 batches 1, 3, 5 and an empty one.
    # A rank that skipped its empty batch would leave rank 0 alone in FSDP's all-gathers of its last forward
    # (gloo's timeout then fails this test instead of a hang).
    assert forwards == [2, 2, 2, 2], (rank, forwards)
    assert (result.tokens, result.batches) == (13 * SEQ, 7), result
    # The same number as one cross-entropy over every window of the file, on every rank.
    rows = torch.from_numpy(np.fromfile(held_out, dtype=np.uint16).astype(np.int64))
    windows = torch.stack([rows[w * SEQ : w * SEQ + SEQ + 1] for w in range(13)])
    with torch.no_grad():
        logits = trainer.module(windows[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten())
    assert result.loss == pytest.approx(float(expected), rel=1e-5), (rank, result.loss, float(expected))
    trainer.close()


def test_a_rank_with_an_empty_last_batch_runs_it_and_every_rank_gets_the_whole_sets_loss(tmp_path):
    run_ranks(_validate_over_two_fsdp_ranks, 2, tmp_path, str(_token_file(tmp_path, 13)))


def test_an_unreadable_held_out_set_names_eval_data(tmp_path):
    spec = EvalSpec(every=1, data={"kind": "tokens", "path": str(tmp_path / "missing.bin")})
    with pytest.raises(SpecError, match=r"^eval\.data\.path: .*missing\.bin is not a file$"):
        EvalSet(spec, SEQ, 0, 64, 2)


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"every": 2}, "eval: data is missing: name the held-out set"),
        ({"every": 0, "data": {"kind": "tokens", "path": "v.bin"}}, "eval.every: 0 is not a positive number"),
        (
            {"every": 2, "steps": -1, "data": {"kind": "tokens", "path": "v.bin"}},
            "eval.steps: -1 is not a positive",
        ),
        ({"data": {"kind": "tokens", "path": "v.bin"}}, "eval: every is missing"),
        (
            {"every": 2, "data": {"kind": "synthetic"}},
            "eval: steps is missing: a synthetic held-out set has no end",
        ),
        (
            {"only": True, "data": {"kind": "tokens", "path": "v.bin"}},
            "eval.only: true validates trained weights",
        ),
        ({"every": 2, "data": {"kind": "tokens"}}, "eval.data: kind: tokens needs path"),
        ({"every": 2, "date": {}}, "eval.date: unknown key; did you mean 'data'?"),
    ],
)
def test_bad_eval_blocks_are_one_line_naming_the_field(block, expected):
    with pytest.raises(SpecError) as err:
        parse_document(RunConfig, {"eval": block})
    message = str(err.value)
    assert "\n" not in message and expected in message, message


def test_eval_only_with_init_from_or_a_checkpoint_is_valid():
    data = {"kind": "tokens", "path": "v.bin"}
    assert parse_document(
        RunConfig, {"eval": {"only": True, "data": data}, "checkpoint": {"dir": "c"}}
    ).eval.only
    assert parse_document(RunConfig, {"eval": {"every": 5, "data": data}}).eval.every == 5


def test_a_validation_reaches_the_jsonl_the_step_line_prometheus_and_the_plot(tmp_path):
    from hpkit import plot

    jsonl = tmp_path / "m.jsonl"
    console = io.StringIO()
    logger = MetricsLogger(enabled=True, jsonl_path=jsonl, tensorboard_dir=None, stream=console)
    stats = StepStats(10, 2.5, 0.75, 1e-3, 0.5, 4096, 4, 1e9, None, 1.5, "max_rss")
    stats.eval_loss, stats.eval_perplexity = 2.25, math.exp(2.25)
    logger.log(stats)
    logger.evaluation(EvalEvent(10, loss=2.25, perplexity=math.exp(2.25), tokens=416, batches=7))
    logger.evaluation(EvalEvent(20, loss=2.0, perplexity=math.exp(2.0), tokens=416, batches=7))
    logger.evaluation(EvalEvent(20, loss=9.0, perplexity=math.exp(9.0), tokens=416, batches=7, only=True))
    logger.close()
    assert "| eval loss 2.2500 | eval ppl 9.49" in console.getvalue()
    records = [parse_record(json.loads(line)) for line in jsonl.read_text().splitlines()]
    assert records[1] == EvalEvent(
        10, loss=2.25, perplexity=math.exp(2.25), tokens=416, batches=7, time=records[1].time
    )
    assert records[1].time is not None

    run = plot.TrainingRun("m", read_metrics(jsonl))
    loss_ax = plot.training_figure([run], (800, 600)).axes[0]
    evals = [line for line in loss_ax.get_lines() if line.get_gid() == "eval_loss:0"]
    assert len(evals) == 1, "one validation curve; the eval.only record is not on it"
    assert list(evals[0].get_xdata()) == [10, 20] and list(evals[0].get_ydata()) == [2.25, 2.0]

    exp = PrometheusExporter(PrometheusSpec(textfile_dir=str(tmp_path / "prom")), "r", "7", 0, 0, "n")
    text = (tmp_path / "prom" / "r-7-rank0.prom").read_text()
    assert "hpkit_train_eval_loss{" not in text, "no validation yet: no sample (not a loss of 0)"
    exp.evaluation(20, 2.0, math.exp(2.0))
    got = {
        s.name: s.value
        for f in text_string_to_metric_families((tmp_path / "prom" / "r-7-rank0.prom").read_text())
        for s in f.samples
    }
    assert got["hpkit_train_eval_loss"] == 2.0
    assert got["hpkit_train_eval_perplexity"] == pytest.approx(math.exp(2.0))
    assert got["hpkit_train_eval_step"] == 20
    exp.close()
