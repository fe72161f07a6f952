"""hpkit's MoE training step against a plain-PyTorch MoE loop: transformers' MixtralForCausalLM, one process.

Same shape on both sides: dim 256, 6 blocks, 16 heads, vocab 2048, every block's FFN 8 SwiGLU experts of
768, top 2, no shared expert (Mixtral has none), seq 256, local batch 8, fp32, AdamW lr 8e-4 (2 warm-up
steps), weight decay 0.1, clip 1.0, the balance loss at 0.01 on both sides, OMP_NUM_THREADS=1, the loss read
every step on both sides. transformers' Mixtral block is the plain eager MoE (a loop over experts with index
masks), written by no one here: the reference for what a straightforward MoE costs in PyTorch. Each run's
figure is tokens/s from the median step time over steps 3..N; the sides alternate so that a shared
machine's load falls on both alike, and the ratio of medians and the median of per-round ratios are printed.

    python3 bench/bench_moe_vs_mixtral.py [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _sides import REPO, alternate, ratio_line, run_env

SEQ, LOCAL_BATCH, LR, WARMUP, WD, CLIP, AUX = 256, 8, 8e-4, 2, 0.1, 1.0, 0.01
SHAPE = {"dim": 256, "n_layers": 6, "n_heads": 16, "ffn_dim": 768, "vocab_size": 2048}
EXPERTS, TOP_K = 8, 2


def hpkit_side(steps: int, out: Path) -> list[float]:
    cfg = {
        "name": "moe-bench",
        "output_dir": str(out),
        "parallelism": {"dp_shard": 1},
        "model": {
            "name": "debug",
            **SHAPE,
            "seq_len": SEQ,
            "moe": {
                "experts": EXPERTS,
                "top_k": TOP_K,
                "shared_experts": 0,
                "every": 1,
                "aux_loss_coef": AUX,
            },
        },
        "train": {
            "steps": steps,
            "local_batch_size": LOCAL_BATCH,
            "lr": LR,
            "warmup_steps": WARMUP,
            "weight_decay": WD,
            "grad_clip": CLIP,
            "mixed_precision": "fp32",
            "log_every": 1,
            "tensorboard": False,
            "metrics_file": str(out / "metrics.jsonl"),
        },
    }
    path = out / "config.json"
    path.write_text(json.dumps(cfg))
    subprocess.run(
        [sys.executable, "-m", "hpkit", "train", "--config", str(path)],
        env=run_env(out),
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=REPO,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "event" not in r]


def mixtral_side(steps: int, out: Path) -> list[float]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--mixtral-loop", str(steps)],
        env=run_env(out),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def mixtral_loop(steps: int) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=SHAPE["vocab_size"],
        hidden_size=SHAPE["dim"],
        intermediate_size=SHAPE["ffn_dim"],
        num_hidden_layers=SHAPE["n_layers"],
        num_attention_heads=SHAPE["n_heads"],
        num_key_value_heads=SHAPE["n_heads"],
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=SEQ,
        output_router_logits=True,
        router_aux_loss_coef=AUX,
        sliding_window=None,
        attn_implementation="sdpa",
    )
    model = MixtralForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = LR * min(1.0, step / WARMUP)
        tokens = torch.randint(0, SHAPE["vocab_size"], (LOCAL_BATCH, SEQ + 1), generator=gen)
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # read every step, as the hpkit side logs every step
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def tokens_per_s(step_times: list[float]) -> float:
    return LOCAL_BATCH * SEQ / statistics.median(step_times[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--mixtral-loop", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mixtral_loop:
        mixtral_loop(args.mixtral_loop)
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_moe_vs_mixtral: needs transformers (pip install 'hpkit[train,hf]' transformers)")
        return 2
    results = alternate(
        {
            "hpkit": lambda out: tokens_per_s(hpkit_side(args.steps, out)),
            "mixtral": lambda out: tokens_per_s(mixtral_side(args.steps, out)),
        },
        args.rounds,
    )
    print(ratio_line("hpkit", results["hpkit"], "Mixtral", results["mixtral"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
