"""`hpkit plan`'s speed ranking against measurement: 8 layouts of one model on 4 local gloo ranks.

One launch of 4 ranks (torchrun, this machine). First a short probe, all ranks at once as training runs them,
measures a matmul's FLOP/s per rank, an operator's dispatch cost, memory bandwidth, and gloo's all-reduce
bandwidth and latency. Those figures replace the catalog's in the planner's speed model
(hpkit.plan.speed.Hardware: one "node" of 4 ranks, no overlap of communication with compute, since gloo and the
matmuls share the same cores), which predicts each layout's tokens/s. Then the same processes build hpkit's
Trainer for every layout (the same global batch) and step them in turn, one step of each, the order rotating
every round, so that the load of a shared machine falls on all of them alike; each layout's figure is its
median step. Printed: the table (predicted and measured, with ranks) and Spearman's rho between the two
orders (target >= 0.8); written to bench/results/plan-ranking-DATE-TIME.json.

    python3 bench/bench_plan_ranking.py [--steps 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _sides import REPO, run_env

sys.path.insert(0, str(REPO / "python"))

MODEL = {"name": "debug", "seq_len": 128}
GLOBAL_BATCH = 8
WORLD = 4

# name -> (parallelism, local batch, activation checkpointing). The global batch is GLOBAL_BATCH throughout.
LAYOUTS: dict[str, tuple[dict, int, str]] = {
    "fsdp4": ({"dp_shard": 4}, 2, "none"),
    "ddp4": ({"dp_replicate": 4, "dp_shard": 1}, 2, "none"),
    "fsdp4-ac": ({"dp_shard": 4}, 2, "full"),
    "hsdp2x2": ({"dp_replicate": 2, "dp_shard": 2}, 2, "none"),
    "tp2-fsdp2": ({"dp_shard": 2, "tp": 2}, 4, "none"),
    "tp4": ({"dp_shard": 1, "tp": 4}, 8, "none"),
    "pp2-fsdp2": ({"dp_shard": 2, "pp": 2, "microbatches": 2, "pp_schedule": "1f1b"}, 4, "none"),
    "pp4-gpipe": ({"dp_shard": 1, "pp": 4, "microbatches": 4, "pp_schedule": "gpipe"}, 8, "none"),
}


def torchrun(args: list[str], tmp: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", *args]
    done = subprocess.run(cmd, env=run_env(tmp), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


# ---- inside torchrun: python bench/bench_plan_ranking.py --worker OUT -----------------------------------


def probe() -> dict[str, float]:
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)

    def timed(fn, reps: int) -> float:
        fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) / reps

    # A matmul the size of the model's (tokens x dim @ dim x ffn), all ranks at once.
    a, b = torch.randn(256, 256), torch.randn(256, 768)
    mm_s = timed(lambda: a @ b, 20)
    matmul_flops = 2 * 256 * 256 * 768 / mm_s
    # An operator's dispatch: small elementwise ops with autograd, forward and backward.
    x = torch.randn(8, 8, requires_grad=True)

    def small() -> None:
        y = x
        for _ in range(20):
            y = y * 1.0001
        y.sum().backward()

    op_s = timed(small, 20) / 41
    big = torch.randn(8 * 2**20 // 4)
    mem_bw = 2 * big.numel() * 4 / timed(lambda: big.clone(), 10)
    buf = torch.zeros(2**20)  # 4 MiB
    ar_s = timed(lambda: dist.all_reduce(buf), 5)
    bw = 2 * (n - 1) / n * buf.numel() * 4 / ar_s
    tiny = torch.zeros(1)
    latency = timed(lambda: dist.all_reduce(tiny), 20) / (2 * (n - 1))
    # A tensor-parallel linear's own cost beyond its math and its collective: DTensor's dispatch, which a GPU
    # hides behind its kernels and a CPU rank pays in full. Column- then row-wise pair, tiny, against the same
    # pair unsharded plus the one all-reduce it issues.
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    pair = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    plain = nn.Sequential(nn.Linear(64, 64 // n, bias=False), nn.Linear(64 // n, 64, bias=False))
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    xs = torch.randn(4, 64, requires_grad=True)
    small_buf = torch.zeros(4, 64)
    dt_s = timed(lambda: pair(xs).sum().backward(), 20)
    plain_s = timed(
        lambda: (plain(xs).sum().backward(), dist.all_reduce(small_buf), dist.all_reduce(small_buf)), 20
    )
    tp_op = max(0.0, (dt_s - plain_s) / 2)
    # An FSDP unit's collective beyond its bytes and latency (FSDP2's copy-in/out and hooks, gloo's
    # reduce-scatter run as an all-reduce): four fully_shard'ed linears against the same four unsharded, less
    # what the alpha-beta model gives their all-gathers (forward and backward) and reduce-scatters.
    from torch.distributed.fsdp import fully_shard

    def stack() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4)))

    sharded, whole = stack(), stack()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    xb = torch.randn(64, 256)
    fsdp_s = timed(lambda: sharded(xb).sum().backward(), 10)
    whole_s = timed(lambda: whole(xb).sum().backward(), 10)
    unit_bytes = 256 * 256 * 4
    ring = (n - 1) * latency + (n - 1) / n * unit_bytes / (bw or 1)
    fsdp_op = max(0.0, (fsdp_s - whole_s - 4 * 3 * ring) / (4 * 3))
    figures = torch.tensor([matmul_flops, op_s, mem_bw, bw, latency, tp_op, fsdp_op], dtype=torch.float64)
    dist.all_reduce(figures)  # the mean over ranks
    figures /= n
    keys = (
        "matmul_flops",
        "op_overhead_s",
        "mem_bw",
        "allreduce_busbw",
        "latency_s",
        "tp_op_overhead_s",
        "fsdp_collective_overhead_s",
    )
    return dict(zip(keys, figures.tolist(), strict=True))


# ---- prediction and measurement ----------------------------------------------------------------------------


def hardware(measured: dict):
    from hpkit.plan.speed import Hardware

    return Hardware(
        name="this machine (4 gloo ranks)",
        gpus_per_node=WORLD,
        peak_flops=measured["matmul_flops"],
        matmul_flops=measured["matmul_flops"],
        mem_bw=measured["mem_bw"],
        intra_bw=measured["allreduce_busbw"],
        inter_bw_node=measured["allreduce_busbw"],
        latency_intra_s=measured["latency_s"],
        latency_inter_s=measured["latency_s"],
        op_overhead_s=measured["op_overhead_s"],
        tp_op_overhead_s=measured["tp_op_overhead_s"],
        fsdp_collective_overhead_s=measured["fsdp_collective_overhead_s"],
        overlap=False,
        # 4 ranks on this machine's 2 shared cores: a rank that waits (a pipeline bubble) gives its core to another
        shared_cores=True,
    )


def predicted(hw) -> dict[str, float]:
    from hpkit.models.llama.shape import shape_named
    from hpkit.plan.layout import Layout
    from hpkit.plan.speed import predict
    from hpkit.runtime.config import RunConfig

    shape = shape_named(MODEL["name"], MODEL["seq_len"])
    out = {}
    for name, (par, lbs, ac) in LAYOUTS.items():
        cfg = RunConfig(
            model=MODEL,
            parallelism=par,
            train={"local_batch_size": lbs, "activation_checkpoint": ac, "mixed_precision": "fp32"},
        )
        layout = Layout.from_run_config(cfg, world=WORLD, device_type="cpu")
        assert layout.global_batch == GLOBAL_BATCH, name
        out[name] = predict(shape, layout, hw).tokens_per_s_per_gpu * WORLD
    return out


def worker(out: str, steps: int, warmup: int) -> None:
    """Inside torchrun: the probe, then every layout's Trainer stepped in turn."""
    import torch.distributed as dist

    from hpkit.runtime.config import RunConfig
    from hpkit.runtime.env import distributed
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.runtime.run import quiet_known_warnings

    quiet_known_warnings()
    with distributed() as job:
        figures = probe()
        trainers = {}
        for name, (par, lbs, ac) in LAYOUTS.items():
            cfg = RunConfig(
                model=MODEL,
                parallelism=par,
                train={
                    "local_batch_size": lbs,
                    "activation_checkpoint": ac,
                    "mixed_precision": "fp32",
                    "tensorboard": False,
                    "stragglers": {"enabled": False},
                },
            )
            trainers[name] = Trainer(cfg, job.device)
        names = list(trainers)
        for _ in range(warmup):
            for name in names:
                trainers[name].train_step()
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(steps):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                dist.barrier()
                times[name].append(trainers[name].train_step().step_time_s)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({"probe": figures, "step_times_s": times}))


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: -values[i])
    out = [0.0] * len(values)
    for r, i in enumerate(order):
        out[i] = r + 1.0
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps of each layout")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup)
        return 0
    import tempfile

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        out = tmp / "result.json"
        torchrun(
            [
                str(Path(__file__).resolve()),
                "--worker",
                str(out),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ],
            tmp,
        )
        result = json.loads(out.read_text())
    measured_hw, times = result["probe"], result["step_times_s"]
    print("probe:", ", ".join(f"{k} {v:.3g}" for k, v in measured_hw.items()), flush=True)
    pred = predicted(hardware(measured_hw))
    tokens = GLOBAL_BATCH * MODEL["seq_len"]
    meas = {name: tokens / statistics.median(v) for name, v in times.items()}
    names = list(LAYOUTS)
    rp, rm = ranks([pred[n] for n in names]), ranks([meas[n] for n in names])
    print(f"\n{'layout':<11} {'predicted tok/s':>15} {'rank':>4} {'measured tok/s':>14} {'rank':>4}")
    for n, a, b in zip(names, rp, rm, strict=True):
        print(f"{n:<11} {pred[n]:>15,.0f} {a:>4.0f} {meas[n]:>14,.0f} {b:>4.0f}")
    rho = spearman([pred[n] for n in names], [meas[n] for n in names])
    load = os.getloadavg()[0]
    print(
        f"\nSpearman rho {rho:.3f} (target >= 0.8) over {len(names)} layouts, {args.steps} steps each, "
        f"{time.time() - start:.0f} s, load {load:.1f}"
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M")
    results = REPO / "bench" / "results" / f"plan-ranking-{stamp}.json"
    document = {
        "probe": measured_hw,
        "predicted_tokens_per_s": pred,
        "measured_tokens_per_s": meas,
        "step_times_s": times,
        "spearman_rho": rho,
        "steps": args.steps,
        "load_average": load,
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "world": WORLD,
        "command": "python3 bench/bench_plan_ranking.py " + " ".join(sys.argv[1:]),
    }
    results.write_text(json.dumps(document, indent=2) + "\n")
    print(f"RATIO plan_ranking spearman_rho = {rho:.3f} (target >= 0.8; {results.relative_to(REPO)})")
    return 0 if rho >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
