"""Validation in real layouts, through `hpkit train`'s own run (runtime.run._train), for
tests/integration/test_validation.py.

`world4 DIR`, under torchrun with 4 processes, the runs of WORLD4 in order:
  1. trains TRAIN_STEPS steps in fsdp 2 x tp 2, validating every EVAL_EVERY steps on a held-out set of 13
     windows in batches of 2: 7 batches over 2 data-parallel ranks (rank 1 runs an empty batch in the last
     round, and batch 6 holds one sample), saving a checkpoint at each validation;
  2. the same in pp 2 x fsdp 2 (the pipeline schedule goes from training to eval() and back);
  3. validates the first run's last checkpoint with eval.only in other layouts (DCP reshards it), each with
     its own batch size (global batch 4), so that the batches and their split differ;
  4. the same for a mixture of experts: trained under ep 2 x fsdp 2, validated under ep 2 x tp 2 and fsdp 4;
  5. the same with a chat held-out set (DIR/chat, from `hpkit data prepare --format chat`, which the test
     writes): labels masked outside assistant turns, packed conversations with their own positions; trained
     under pp 2 x fsdp 2, validated under fsdp 2 x tp 2 (a vocabulary-parallel loss over masked labels).
`world1 DIR`, as one process beside the world4 launch: eval.only of the first and the chat run's checkpoints
once DIR/world4.done says that launch ended well (the test writes it), and the expected values
computed without the evaluator: every window (row) of the held-out set, read from the file(s), through the
one-process model, the cross-entropy of all their counted tokens in one call.
Before that wait it validates, with eval.only and no checkpoint, the weights of a tiny random Llama that transformers
saves to DIR/hf (model.init_from), expecting transformers' own loss on the same tokens; and trains LoRA
adapters on that base, validating in training and then with eval.only of the adapters-only checkpoint.
Each run writes its metrics JSONL under DIR/<tag>/; world1 also writes DIR/expected.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training_layouts import BASE

GLOBAL_BATCH = 4
TRAIN_STEPS = 4
EVAL_EVERY = 2
WINDOWS = 13  # 6 full batches of 2 and one of 1: 7 batches
VOCAB = BASE["model"]["vocab_size"]
SEQ = BASE["model"]["seq_len"]
# A rank still inside one run after this long (left waiting in a collective: a validation that hangs) ends
# with its stacks on stderr instead of hanging the test; a run takes a few seconds.
RUN_TIMEOUT_S = 150.0
MOE = {"experts": 4, "top_k": 2, "shared_experts": 1, "every": 1, "aux_loss_coef": 0.1}
PP2_FSDP2 = {"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "1f1b"}
PP2_TP2_INTERLEAVED = {
    "pp": 2,
    "dp_shard": 1,
    "tp": 2,
    "microbatches": 2,
    "pp_schedule": "interleaved_1f1b",
    "stages_per_rank": 2,
}


@dataclass(frozen=True)
class Run:
    tag: str  # its metrics: DIR/<tag>/metrics.jsonl
    parallelism: dict[str, Any]
    only: bool  # eval.only of the newest checkpoint in DIR/<ckpt>; else train, saving there
    ckpt: str = "ckpt"
    moe: bool = False
    chat: bool = False  # held-out set: DIR/chat (a prepared chat set), and a vocabulary that covers it
    init_from: bool = False  # the model and its weights: DIR/hf (no checkpoint unless lora)
    lora: bool = False  # adapters on the init_from base


WORLD4 = [
    Run("train-fsdp2_tp2", {"dp_shard": 2, "tp": 2}, only=False),
    Run("train-pp2_fsdp2", PP2_FSDP2, only=False, ckpt="ckpt-pp"),
    # Batches of 1: 13 batches over 4 ranks, three of them with an empty batch in the last round.
    Run("only-fsdp4", {"dp_shard": 4}, only=True),
    Run("only-hsdp", {"dp_replicate": 2, "dp_shard": 2}, only=True),
    Run("only-tp4", {"dp_shard": 1, "tp": 4}, only=True),
    Run("only-fsdp2_tp2", {"dp_shard": 2, "tp": 2}, only=True),
    Run("only-pp2_fsdp2", PP2_FSDP2, only=True),
    Run("only-pp2_tp2_interleaved", PP2_TP2_INTERLEAVED, only=True),
    Run("moe-train-ep2_fsdp2", {"dp_shard": 2, "ep": 2}, only=False, ckpt="ckpt-moe", moe=True),
    Run("moe-only-ep2_tp2", {"dp_shard": 1, "ep": 2, "tp": 2}, only=True, ckpt="ckpt-moe", moe=True),
    Run("moe-only-fsdp4", {"dp_shard": 4}, only=True, ckpt="ckpt-moe", moe=True),
    Run("chat-train-pp2_fsdp2", PP2_FSDP2, only=False, ckpt="ckpt-chat", chat=True),
    Run("chat-only-fsdp2_tp2", {"dp_shard": 2, "tp": 2}, only=True, ckpt="ckpt-chat", chat=True),
]
SINGLE = Run("only-single", {"dp_shard": 1}, only=True)
SINGLE_CHAT = Run("chat-only-single", {"dp_shard": 1}, only=True, ckpt="ckpt-chat", chat=True)
SINGLE_INIT = Run("init-only-single", {"dp_shard": 1}, only=True, init_from=True)
SINGLE_LORA = [
    Run("lora-train-single", {"dp_shard": 1}, only=False, ckpt="ckpt-lora", init_from=True, lora=True),
    Run("lora-only-single", {"dp_shard": 1}, only=True, ckpt="ckpt-lora", init_from=True, lora=True),
]
CHAT_VOCAB = 512  # the test's chat tokenizer has about 400 tokens
CHAT_SEQ = 128  # rows of several packed conversations (the test prepares the set with this --seq-len)


def write_data(root: Path) -> tuple[Path, Path]:
    import numpy as np

    train, held_out = root / "train.bin", root / "held_out.bin"
    if not held_out.exists():
        rng = np.random.default_rng(7)
        rng.integers(0, VOCAB, 40 * SEQ + 1).astype(np.uint16).tofile(train)
        rng.integers(0, VOCAB, WINDOWS * SEQ + 1).astype(np.uint16).tofile(held_out)
    return train, held_out


def config(root: Path, run: Run, world: int):
    from hpkit.runtime.config import RunConfig
    from hpkit.runtime.parallel.parallel_dims import ParallelDims
    from hpkit.validation import parse_document

    train, held_out = write_data(root)
    data: dict[str, Any] = {
        "name": f"validation-{run.tag}",
        "output_dir": str(root / run.tag),
        "parallelism": run.parallelism,
        "model": {
            **BASE["model"],
            **({"moe": MOE} if run.moe else {}),
            **({"vocab_size": CHAT_VOCAB, "seq_len": CHAT_SEQ} if run.chat else {}),
        },
        "train": {
            **BASE["train"],
            "steps": TRAIN_STEPS,
            "metrics_file": "metrics.jsonl",
            "stragglers": {"enabled": False},
            "data": {"kind": "tokens", "path": str(train)},
        },
        "eval": {
            **({"only": True} if run.only else {"every": EVAL_EVERY}),
            "data": {"kind": "prepared", "path": str(root / "chat")}
            if run.chat
            else {"kind": "tokens", "path": str(held_out)},
        },
        "checkpoint": {
            "dir": None if run.init_from and not run.lora else str(root / run.ckpt),
            "interval": EVAL_EVERY,
            "keep": 2,
        },
        "resilience": {"hang": {"enabled": False}},
    }
    if run.init_from:
        data["model"] = {"init_from": str(root / "hf"), "seq_len": SEQ}
        if run.lora:
            data["model"]["lora"] = {"rank": 4, "alpha": 8.0}
    dp = ParallelDims.from_spec(parse_document(RunConfig, data).parallelism, world).dp
    data["train"]["local_batch_size"] = GLOBAL_BATCH // dp
    return parse_document(RunConfig, data)


def held_out_rows(root: Path, chat: bool) -> tuple[Any, Any, Any]:
    """(inputs, labels, positions or None) of every sample of the held-out set, read from its files."""
    import numpy as np
    import torch

    if not chat:
        tokens = np.fromfile(root / "held_out.bin", dtype=np.uint16).astype(np.int64)
        rows = torch.from_numpy(np.stack([tokens[w * SEQ : w * SEQ + SEQ + 1] for w in range(WINDOWS)]))
        return rows[:, :-1], rows[:, 1:], None
    from hpkit.data.chat import row_labels_positions
    from hpkit.data.index import flags_name, read_index
    from hpkit.runtime.loop.loss import IGNORE_INDEX

    index = read_index(root / "chat")
    ids = np.concatenate([np.fromfile(index.path / s.name, dtype=index.dtype) for s in index.shards])
    flags = np.concatenate(
        [np.fromfile(index.path / flags_name(s.name), dtype=np.uint8) for s in index.shards]
    )
    width = CHAT_SEQ + 1
    inputs, labels, positions = row_labels_positions(
        ids.reshape(-1, width).astype(np.int64), flags.reshape(-1, width), IGNORE_INDEX
    )
    return (
        torch.from_numpy(inputs),
        torch.from_numpy(labels),
        torch.from_numpy(np.ascontiguousarray(positions)),
    )


def expected(root: Path, cfg: Any, device: Any, run: Run) -> dict[str, float]:
    """The checkpoint's loss over every counted held-out token, from the files: no evaluator, no batches."""
    import torch
    import torch.nn.functional as F

    from hpkit.runtime.checkpoints.checkpoint import Checkpointer
    from hpkit.runtime.loop.trainer import Trainer

    trainer = Trainer(cfg, device)
    checkpointer = Checkpointer(
        cfg.checkpoint, root / run.ckpt, 0, layout=trainer.dims.degrees(), model=trainer.model_record()
    )
    path = trainer.resume(checkpointer)
    assert path is not None and trainer.step == TRAIN_STEPS, path
    inputs, labels, positions = held_out_rows(root, run.chat)
    with torch.no_grad():
        logits = trainer.module(inputs, **({"positions": positions} if positions is not None else {}))
        loss = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100)
    checkpointer.close()
    trainer.close()
    return {
        "step": trainer.step,
        "loss": float(loss),
        "tokens": int((labels != -100).sum()),
        "all_tokens": int(labels.numel()),
        "rows": int(labels.shape[0]),
    }


def make_hf(root: Path) -> Any:
    """A tiny random Llama as transformers saves it (config.json + safetensors), vocabulary VOCAB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(root / "hf")
    return model


def transformers_loss(model: Any, root: Path) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    inputs, labels, _ = held_out_rows(root, chat=False)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten())
    return {"step": 0, "loss": float(loss), "tokens": int(labels.numel())}


def train(cfg: Any, job: Any) -> int:
    """One run through `hpkit train`'s own loop, ended with every stack if it hangs."""
    import faulthandler

    from hpkit.runtime.run import _train

    faulthandler.dump_traceback_later(RUN_TIMEOUT_S, exit=True)
    try:
        return _train(cfg, job.launch, job.device)
    finally:
        faulthandler.cancel_dump_traceback_later()


WORLD4_DONE = "world4.done"  # DIR/world4.done: the test writes "ok" or "failed" once the world4 launch ended


def wait_for_world4(root: Path) -> None:
    """Until the world4 launch has ended (its checkpoints are what SINGLE and SINGLE_CHAT validate)."""
    import time

    done = root / WORLD4_DONE
    while not done.exists():
        time.sleep(0.1)
    if done.read_text().strip() != "ok":
        raise SystemExit("the world4 launch failed: its checkpoints are missing")


def main(mode: str, root: Path) -> int:
    from hpkit.runtime.env import distributed
    from hpkit.runtime.run import quiet_known_warnings

    quiet_known_warnings()
    with distributed(timeout_s=RUN_TIMEOUT_S) as job:
        world = job.launch.world_size
        if mode == "world4":
            for run in WORLD4:
                assert train(config(root, run, world), job) == 0, run.tag
        else:
            values = {}
            # What needs no world4 checkpoint first, while the world4 launch runs beside this one.
            reference = make_hf(root)
            assert train(config(root, SINGLE_INIT, world), job) == 0
            values[SINGLE_INIT.tag] = transformers_loss(reference, root)
            for run in SINGLE_LORA:
                assert train(config(root, run, world), job) == 0, run.tag
            wait_for_world4(root)
            for run in (SINGLE, SINGLE_CHAT):
                cfg = config(root, run, world)
                assert train(cfg, job) == 0, run.tag
                values[run.tag] = expected(root, cfg, job.device, run)
            (root / "expected.json").write_text(json.dumps(values))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
