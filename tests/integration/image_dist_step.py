"""One distributed training step for running inside the CPU image under torchrun.

gloo all_reduce of each rank's id, then one DDP step of a small model; rank 0 prints what the test checks.
The image's own hpkit (installed from this checkout when the test builds the image) joins the process group.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpkit import exit_settle
from hpkit.runtime.env import distributed


def main() -> None:
    # DDP keeps gloo work alive past the process group; without the settle a gloo thread freeing it at exit
    # aborts the process ("terminate called without an active exception"), as it did in CI.
    exit_settle.install()
    with distributed():
        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        expected = world * (world + 1) / 2

        torch.manual_seed(0)  # the same initial weights everywhere; DDP also broadcasts rank 0's
        model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)  # each rank its own batch
        inputs, targets = torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

        # After a DDP step every rank must hold the same weights: compare a checksum across ranks.
        checksum = torch.stack([p.detach().sum() for p in model.parameters()]).sum().reshape(1)
        gathered = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(gathered, checksum)
        in_sync = all(torch.allclose(g, gathered[0]) for g in gathered)
        if rank == 0:
            print(
                f"IMAGE-DIST-STEP world={world} allreduce={total.item():g} expected={expected:g} "
                f"loss={loss.item():.4f} in_sync={in_sync} threads={os.environ.get('OMP_NUM_THREADS')}",
                flush=True,
            )


if __name__ == "__main__":
    main()
