"""SMP compat layer vs the same model parallelised by hand with hpkit's runtime: per-step time, side by side.

Seed 000's Net and training step. The shim runs the seed's code path (smp.DistributedModel, @smp.step,
model.backward, reduce_mean); the direct loop splits Net by hand into the same two stages, applies the same
TP plan with parallelize_module, FSDP2 replicas and hpkit's pipeline schedule, and calls schedule.step.
Both run in the same processes on the same mesh, alternating step by step, so a noisy machine slows
both alike; the ratio of median step times is printed at the end (target: shim / direct <= 1.02).

    torchrun --nproc-per-node 2 bench/bench_compat_smp.py                  # pp 2, microbatches 4
    torchrun --nproc-per-node 4 bench/bench_compat_smp.py --tp 2           # tp 2 x pp 2
    torchrun --nproc-per-node 2 bench/bench_compat_smp.py --pp 1 --tp 2    # tp 2 alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "python/hpkit/compat/shim"))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=1, help="timed steps per round, each loop")
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args()


def main() -> int:
    args = _parse()
    import smdistributed.modelparallel.torch as smp
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):  # seed 000
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = F.relu(self.fc1(torch.flatten(x, 1)))
            return F.log_softmax(self.fc2(x), 1)

    smp.init(
        {
            "tensor_parallel_degree": args.tp,
            "pipeline_parallel_degree": args.pp,
            "microbatches": args.microbatches,
            "ddp": True,
            "pipeline": "simple",
        }
    )
    torch.manual_seed(0)
    from hpkit.compat.smp import topology

    data = torch.randn(args.batch, 1, 28, 28, device=topology.state().device)
    target = torch.randint(0, 10, (args.batch,), device=data.device)

    # --- the shim, as seed 000's second script uses it
    with smp.tensor_parallelism():
        net = Net()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=4.0))

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target, reduction="mean")
        model.backward(loss)
        return output, loss

    def shim_step() -> float:
        opt.zero_grad()
        _, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()
        opt.step()
        return loss.item()

    # --- the same model by hand on hpkit's runtime and the same mesh
    direct_step = _direct(args, Net, data, target)

    times: dict[str, list[float]] = {"shim": [], "direct": []}
    # CPU seconds the ranks spent: on a shared machine, less disturbed by other processes than wall time.
    cpu = {"shim": 0.0, "direct": 0.0}
    for fn in (shim_step, direct_step):
        for _ in range(args.warmup):
            fn()
    for _ in range(args.rounds):
        for name, fn in (("shim", shim_step), ("direct", direct_step)):
            for _ in range(args.steps):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name] += time.process_time() - c0
    cpu_total = torch.tensor([cpu["shim"], cpu["direct"]], dtype=torch.float64)
    dist.all_reduce(cpu_total)
    if dist.get_rank() == 0:
        shim, direct = statistics.median(times["shim"]), statistics.median(times["direct"])
        layout = f"tp={args.tp} pp={args.pp} dp={smp.dp_size()} microbatches={args.microbatches}"
        print(f"layout: {layout}, batch {args.batch}, {len(times['shim'])} steps each")
        print(f"{'loop':8} {'median step ms':>15}")
        print(f"{'shim':8} {shim * 1e3:15.1f}")
        print(f"{'direct':8} {direct * 1e3:15.1f}")
        fastest = min(times["shim"]) / min(times["direct"])
        print(f"ratio shim/direct: {shim / direct:.3f} median, {fastest:.3f} fastest step (target <= 1.02)")
        record = {
            "shim_ms": shim * 1e3,
            "direct_ms": direct * 1e3,
            "ratio": shim / direct,
            "ratio_min": fastest,
            "cpu_ratio": float(cpu_total[0] / cpu_total[1]),
        }
        print(f"CPU time of all ranks, shim/direct: {record['cpu_ratio']:.3f}")
        print("bench-compat-smp " + json.dumps(record))
    return 0


def _direct(args, net_cls, data, target):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hpkit.compat.smp import topology
    from hpkit.runtime.parallel.pipeline import build_schedule

    st = topology.state()
    coords = st.coords
    torch.manual_seed(0)
    full = net_cls().to(st.device)

    class Front(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = full.conv1, full.conv2

        def forward(self, x):
            x = F.relu(self.conv1(x))
            return torch.flatten(F.max_pool2d(F.relu(self.conv2(x)), 2), 1)

    class Back(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = full.fc1, full.fc2

        def forward(self, x):
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), 1)

    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.front, self.back = Front(), Back()

        def forward(self, x):
            return self.back(self.front(x))

    if args.pp > 1:
        part: nn.Module = Front() if coords.pp_rank == 0 else Back()
    else:
        part = Whole()
    if args.tp > 1 and not isinstance(part, Front):
        prefix = "" if isinstance(part, Back) else "back."
        parallelize_module(
            part, coords.tp_mesh, {f"{prefix}fc1": ColwiseParallel(), f"{prefix}fc2": RowwiseParallel()}
        )
    if coords.fsdp_mesh is not None:
        fully_shard(part, mesh=coords.fsdp_mesh, reshard_after_forward=False)
    elif coords.ddp_mesh is not None:
        from hpkit.runtime.parallel.fsdp import apply_ddp

        part = apply_ddp(part, coords.ddp_mesh, st.device)
    opt = torch.optim.Adadelta(part.parameters(), lr=4.0)

    def loss_fn(output, tgt):
        return F.nll_loss(output, tgt, reduction="mean")

    if args.pp > 1:
        schedule = build_schedule(part, coords.pp_mesh, st.device, args.microbatches, "gpipe", loss_fn)

        def step() -> None:
            opt.zero_grad()
            losses: list = []
            if coords.pp_rank == 0:
                schedule.step(data, target=target, losses=losses)
            else:
                schedule.step(target=target, losses=losses)
            opt.step()

    else:
        n = args.microbatches

        def step() -> None:
            opt.zero_grad()
            for i, (x, y) in enumerate(zip(data.tensor_split(n), target.tensor_split(n), strict=True)):
                if coords.fsdp_mesh is not None:
                    part.set_requires_gradient_sync(i == n - 1)
                (loss_fn(part(x), y) / n).backward()
            opt.step()

    return step


if __name__ == "__main__":
    sys.exit(main())
