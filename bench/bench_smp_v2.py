"""An SMP v2 script through hpkit's `torch.sagemaker` layer, against hpkit's own runtime and against the same
Hugging Face model in a plain FSDP2 loop, on the same shape and layout, alternating.

Shape: Llama, dim 256, 4 blocks, 8 heads (8 kv), SwiGLU 768, vocab 2048, seq 256, 2 ranks (gloo, CPU),
global batch 8 (4 per rank), fully sharded over both ranks (hybrid_shard_degree 2 = dp_shard 2), fp32, AdamW,
clip 1.0. Sides:
- smp_v2: tests/integration/sagemaker_scripts/smp_v2_train.py, unchanged, under `compat: [smp_v2]`'s preload
  (transformers' LlamaForCausalLM; the script's FullyShardedDataParallel is hpkit's, on FSDP2);
- fsdp2: the same transformers model, `fully_shard` per decoder layer and the root, written by hand: what
  the shim would cost if it cost nothing;
- hpkit: `hpkit train` on hpkit's own Llama of the same shape (dp_shard 2).
smp_v2 / fsdp2 is the shim's own cost (target <= 1.05 in time, >= 0.95 in tokens/s); smp_v2 / hpkit adds
the difference between transformers' model code and hpkit's. Tokens/s from the median step over steps 3..N.

    python3 bench/bench_smp_v2.py [--rounds 3] [--steps 12]
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

SCRIPT = REPO / "tests/integration/sagemaker_scripts/smp_v2_train.py"
DIM, LAYERS, HEADS, FFN, VOCAB, SEQ, GLOBAL_BATCH, PROCS = 256, 4, 8, 768, 2048, 256, 8, 2
SHAPE_ARGS = [
    *("--hidden_size", str(DIM), "--num_layers", str(LAYERS), "--num_heads", str(HEADS)),
    *("--num_kv_heads", str(HEADS), "--intermediate_size", str(FFN), "--vocab_size", str(VOCAB)),
    *("--seq", str(SEQ), "--global_batch", str(GLOBAL_BATCH), "--lr", "3e-4"),
]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PROCS}", *args]


def smp_v2_side(steps: int, out: Path) -> list[float]:
    cmd = _torchrun(
        "-m", "hpkit.run_script", str(SCRIPT), "--hybrid_shard_degree", "2", "--max_steps", str(steps)
    )
    env = run_env(out, HPKIT_PRELOAD="hpkit.compat.smp_v2:install")
    done = subprocess.run([*cmd, *SHAPE_ARGS], env=env, capture_output=True, text=True, check=True, cwd=out)
    return [json.loads(line)["time"] for line in done.stdout.splitlines() if line.startswith('{"step"')]


def fsdp2_side(steps: int, out: Path) -> list[float]:
    cmd = _torchrun(str(Path(__file__).resolve()), "--fsdp2-loop", str(steps))
    done = subprocess.run(cmd, env=run_env(out), capture_output=True, text=True, check=True, cwd=out)
    return json.loads(done.stdout.strip().splitlines()[-1])


def hpkit_side(steps: int, out: Path) -> list[float]:
    cfg = {
        "name": "smp-v2-bench",
        "output_dir": str(out),
        "parallelism": {"dp_shard": PROCS},
        "model": {
            "name": "debug",
            "dim": DIM,
            "n_layers": LAYERS,
            "n_heads": HEADS,
            "n_kv_heads": HEADS,
            "ffn_dim": FFN,
            "vocab_size": VOCAB,
            "seq_len": SEQ,
        },
        "train": {
            "steps": steps,
            "local_batch_size": GLOBAL_BATCH // PROCS,
            "lr": 3e-4,
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "grad_clip": 1.0,
            "mixed_precision": "fp32",
            "log_every": 1,
            "tensorboard": False,
            "metrics_file": str(out / "metrics.jsonl"),
        },
    }
    path = out / "config.json"
    path.write_text(json.dumps(cfg))
    cmd = _torchrun("-m", "hpkit", "train", "--config", str(path))
    subprocess.run(cmd, env=run_env(out), check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "event" not in r]


def fsdp2_loop(steps: int) -> None:
    """The same model and batch as the smp_v2 side, sharded with torch's fully_shard directly."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (PROCS,))
    transformers.set_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    local = GLOBAL_BATCH // PROCS
    times = []
    for step in range(steps):
        start = time.perf_counter()
        g = torch.Generator().manual_seed(1234 * 1000 + step)
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)[rank * local : (rank + 1) * local]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        float(reduced)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def tokens_per_s(step_times: list[float]) -> float:
    return GLOBAL_BATCH * SEQ / statistics.median(step_times[2:])


SIDES = {"smp_v2": smp_v2_side, "fsdp2": fsdp2_side, "hpkit": hpkit_side}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fsdp2-loop", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fsdp2_loop:
        fsdp2_loop(args.fsdp2_loop)
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_smp_v2: needs transformers (pip install 'hpkit[train,hf]')")
        return 2
    results = alternate(
        {name: (lambda out, side=side: tokens_per_s(side(args.steps, out))) for name, side in SIDES.items()},
        args.rounds,
    )
    for other in ("fsdp2", "hpkit"):
        print(ratio_line("smp_v2", results["smp_v2"], other, results[other]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
