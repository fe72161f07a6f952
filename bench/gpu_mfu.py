"""Tokens/s, TFLOP/s and MFU of the ~1B reference model (python/hpkit/models/llama/model.py, shape "1B") on one GPU.

bf16 autocast over fp32 master weights, fused AdamW, synthetic tokens; the FLOP count is the model's
own `flops_per_token` (6 per weight plus causal attention) and the peak comes from the runtime's
table (python/hpkit/runtime/observe/metrics.py), so the figures match what `hpkit train` reports. The first
steps (allocation, cuBLAS autotuning, compile) are left out; the median of the timed steps is used.

    python3 bench/gpu_mfu.py [--batch 2] [--seq-len 2048] [--steps 10] [--ac full] [--compile]

Without a CUDA device it prints "skipped: no CUDA device" and exits 0. `--cpu-dry-run` runs the same
code path on the CPU with the tiny `debug` shape, only to check the script itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1B")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--ac", choices=["none", "full", "selective"], default="none", help="activation checkpointing"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--cpu-dry-run", action="store_true", help="no GPU: run the debug shape on the CPU")
    return p.parse_args()


def main() -> int:
    args = _parse()
    import torch
    import torch.nn.functional as F

    from hpkit.models.llama.model import build_model, config_for
    from hpkit.runtime.observe.metrics import peak_tflops
    from hpkit.runtime.parallel.activation_checkpoint import apply_ac
    from hpkit.runtime.parallel.compile import apply_compile

    if not torch.cuda.is_available():
        if not args.cpu_dry_run:
            print("skipped: no CUDA device")
            return 0
        args.model, args.batch, args.seq_len, args.steps, args.warmup = "debug", 1, 64, 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cfg = config_for(args.model, args.seq_len)
    torch.manual_seed(0)
    model = build_model(cfg, "meta")
    apply_ac(model, args.ac)
    if args.compile:
        apply_compile(model)
    model.to_empty(device=device)
    model.init_weights(0)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device=device)
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    step_s = statistics.median(times)
    tokens_per_s = args.batch * args.seq_len / step_s
    tflops = cfg.flops_per_token(args.seq_len) * tokens_per_s / 1e12
    peak = peak_tflops(name, device.type, "bf16")
    mfu = f"{tflops / peak * 100:.1f}%" if peak else "n/a (peak unknown for this device)"
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(
        f"gpu_mfu: {name}: model {args.model} ({cfg.num_params() / 1e9:.2f}B params), batch {args.batch} x seq "
        f"{args.seq_len}, bf16, ac {args.ac}, compile {args.compile}: step {step_s * 1000:.0f} ms "
        f"(median of {len(times)}), {tokens_per_s:,.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {mfu}, "
        f"peak memory {mem:.1f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
