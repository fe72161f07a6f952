"""Validation (`eval:`) in real layouts: the same number for the same checkpoint in every layout, equal to a
loss computed without the evaluator; an uneven split over data-parallel ranks neither hangs nor drops a
batch; eval.only reproduces the value the training run recorded at that step; a chat set counts only its
assistant tokens, with its packed conversations kept apart.

Two launches side by side (validation_layouts.py): 4 processes run every layout in turn through `hpkit train`'s
own run; one process validates what needs none of their checkpoints, then, once they have ended, computes the
expected values from the held-out files themselves.
"""

from __future__ import annotations

import importlib.util
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _torchrun
import pytest
import validation_layouts as vl

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "validation_layouts.py"
RTOL = 1e-5
ANSWERS = [
    "hello world",
    "4",
    "Paris.",
    "lazy dog.",
    "the quick brown fox jumps over the lazy dog",
    "no, not today",
]


def prepare_chat(root: Path) -> None:
    """A held-out chat set: 14 conversations packed into rows of CHAT_SEQ + 1 tokens (Llama 3's template)."""
    from hpkit.commands import data as data_cmd

    spec = importlib.util.spec_from_file_location(
        "chat_templates", HERE.parent / "unit" / "test_chat_templates.py"
    )
    templates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(templates)
    tokenizer = templates.make_chat_tokenizer(root / "tokenizer", "llama3")
    source = root / "chat.jsonl"
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: what is it?"},
                {"role": "assistant", "content": " ".join([ANSWERS[i % len(ANSWERS)]] * (1 + i % 3))},
            ]
        }
        for i in range(14)
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = [
        "prepare",
        str(source),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(root / "chat"),
        "--format",
        "chat",
    ]
    assert data_cmd.main([*args, "--seq-len", str(vl.CHAT_SEQ)]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("validation")
    prepare_chat(root)
    vl.write_data(root)  # both launches read it: written once, before either starts
    # The one-process launch does what needs no world4 checkpoint while world4 runs, then waits for its word.
    with ThreadPoolExecutor(1) as pool:
        single = pool.submit(_torchrun.run, [str(SCRIPT), "world1", str(root)], root / "tmp1", None, 800)
        try:
            four = _torchrun.run([str(SCRIPT), "world4", str(root)], root / "tmp4", 4, timeout=500)
        except BaseException:
            (root / vl.WORLD4_DONE).write_text("failed\n")
            raise
        (root / vl.WORLD4_DONE).write_text("ok\n")
        one = single.result()
    records = {
        run.tag: [json.loads(line) for line in (root / run.tag / "metrics.jsonl").read_text().splitlines()]
        for run in [*vl.WORLD4, vl.SINGLE, vl.SINGLE_CHAT, vl.SINGLE_INIT, *vl.SINGLE_LORA]
    }
    return {
        "records": records,
        "expected": json.loads((root / "expected.json").read_text()),
        "stdout": four.stdout + one.stdout,
    }


def evals(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r.get("event") == "eval"}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_training_validates_every_n_steps_on_all_seven_batches_of_two_ranks(runs):
    """fsdp 2 x tp 2, batches of 2: 13 samples make 7 batches, rank 1 runs 3 and an empty one. (A rank that
    skipped its empty batch would leave its peers in FSDP's all-gather: the launch would end after
    RUN_TIMEOUT_S with every rank's stack, failing the fixture.)"""
    got = evals(runs["records"]["train-fsdp2_tp2"])
    assert sorted(got) == [2, 4]
    expected = runs["expected"][vl.SINGLE.tag]
    assert expected["tokens"] == vl.WINDOWS * vl.SEQ
    for record in got.values():
        assert record["batches"] == 7 and record["tokens"] == vl.WINDOWS * vl.SEQ, record
        assert record["only"] is False and record["perplexity"] == pytest.approx(math.exp(record["loss"]))
    # Independently: every window of the file through the one-process model, one cross-entropy call.
    assert _rel(got[4]["loss"], expected["loss"]) <= RTOL, (got[4]["loss"], expected["loss"])
    assert got[2]["loss"] != got[4]["loss"], "the weights changed between the validations"


def test_validation_is_the_same_in_every_layout(runs):
    reference = runs["expected"][vl.SINGLE.tag]["loss"]
    tags = [run.tag for run in vl.WORLD4 if not (run.moe or run.chat)] + [vl.SINGLE.tag]
    for tag in tags:
        record = evals(runs["records"][tag])[vl.TRAIN_STEPS]
        assert record["tokens"] == vl.WINDOWS * vl.SEQ, (tag, record)
        assert _rel(record["loss"], reference) <= RTOL, (tag, record["loss"], reference)
    # The split differs with the data-parallel degree: 13 batches of 1 over 4 ranks, 4 batches of 4 on one.
    assert evals(runs["records"]["only-fsdp4"])[4]["batches"] == 13
    assert evals(runs["records"]["only-tp4"])[4]["batches"] == 4


def test_expert_parallel_validates_alike(runs):
    trained = evals(runs["records"]["moe-train-ep2_fsdp2"])[vl.TRAIN_STEPS]
    for tag in ("moe-only-ep2_tp2", "moe-only-fsdp4"):
        got = evals(runs["records"][tag])[vl.TRAIN_STEPS]
        assert got["tokens"] == vl.WINDOWS * vl.SEQ
        assert _rel(got["loss"], trained["loss"]) <= RTOL, (tag, got["loss"], trained["loss"])


def test_pipeline_training_validates_and_trains_on_unchanged(runs):
    """Under pp 2 x fsdp 2 the schedule runs eval() between training steps: the validations match the other
    layout's, and so do the training losses after them (the schedule went back to training intact)."""
    pp, ref = runs["records"]["train-pp2_fsdp2"], runs["records"]["train-fsdp2_tp2"]
    for step, record in evals(ref).items():
        assert _rel(evals(pp)[step]["loss"], record["loss"]) <= RTOL
    losses = {r["step"]: r["loss"] for r in pp if "event" not in r}
    ref_losses = {r["step"]: r["loss"] for r in ref if "event" not in r}
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in ref_losses.items():
        assert _rel(losses[step], loss) <= RTOL, (step, losses[step], loss)


def test_eval_only_equals_the_value_recorded_in_training(runs):
    trained = evals(runs["records"]["train-fsdp2_tp2"])[vl.TRAIN_STEPS]
    only = runs["records"]["only-fsdp2_tp2"]
    got = evals(only)[vl.TRAIN_STEPS]
    assert got["only"] is True
    assert _rel(got["loss"], trained["loss"]) <= RTOL
    assert [r for r in only if r.get("event") != "eval"] == [], "eval.only trains no step and starts no run"
    assert "hpkit train: eval only: step 4 (checkpoint) | eval loss" in runs["stdout"]


def test_the_step_line_carries_the_validation(runs):
    lines = [line for line in runs["stdout"].splitlines() if line.startswith("step     2 |")]
    assert lines and all("| eval loss 6." in line and "| eval ppl " in line for line in lines), lines


def test_a_chat_set_counts_only_assistant_tokens_of_its_packed_conversations(runs):
    """Trained in pp 2 x fsdp 2 (the positions reach every stage), validated in fsdp 2 x tp 2 (a
    vocabulary-parallel loss over masked labels) and in one process: all equal the loss over the counted
    tokens of every row, computed from the shards and their flags with the positions that keep the packed
    conversations apart."""
    expected = runs["expected"][vl.SINGLE_CHAT.tag]
    assert 0 < expected["tokens"] < expected["all_tokens"] / 2, (
        "most tokens (prompts, headers, padding) do not count"
    )
    assert expected["rows"] % 4, "the rows do not divide into the data-parallel ranks' batches"
    trained = evals(runs["records"]["chat-train-pp2_fsdp2"])
    assert sorted(trained) == [2, 4]
    for tag, record in [
        ("chat-train-pp2_fsdp2", trained[vl.TRAIN_STEPS]),
        ("chat-only-fsdp2_tp2", evals(runs["records"]["chat-only-fsdp2_tp2"])[vl.TRAIN_STEPS]),
        (vl.SINGLE_CHAT.tag, evals(runs["records"][vl.SINGLE_CHAT.tag])[vl.TRAIN_STEPS]),
    ]:
        assert record["tokens"] == expected["tokens"], (tag, record)
        assert _rel(record["loss"], expected["loss"]) <= RTOL, (tag, record["loss"], expected["loss"])


def test_eval_only_of_init_from_weights_equals_transformers_loss(runs):
    """No checkpoint: eval.only validates model.init_from's weights as loaded (step 0), and the number is
    transformers' own cross-entropy of LlamaForCausalLM on the same held-out tokens."""
    got = evals(runs["records"][vl.SINGLE_INIT.tag])
    expected = runs["expected"][vl.SINGLE_INIT.tag]
    assert list(got) == [0] and got[0]["only"] is True and got[0]["tokens"] == expected["tokens"]
    assert _rel(got[0]["loss"], expected["loss"]) <= RTOL, (got[0]["loss"], expected["loss"])
    assert "hpkit train: eval only: step 0 (init_from " in runs["stdout"]


def test_eval_only_of_a_lora_checkpoint_equals_the_value_recorded_in_training(runs):
    """A LoRA checkpoint holds only the adapters: eval.only (like any resume) must put them back on the
    init_from base they were trained on, not on a freshly initialised one."""
    trained = evals(runs["records"]["lora-train-single"])
    got = evals(runs["records"]["lora-only-single"])[vl.TRAIN_STEPS]
    assert sorted(trained) == [2, 4] and trained[2]["loss"] != trained[4]["loss"], "the adapters trained"
    assert _rel(got["loss"], trained[vl.TRAIN_STEPS]["loss"]) <= RTOL, (got, trained[vl.TRAIN_STEPS])
