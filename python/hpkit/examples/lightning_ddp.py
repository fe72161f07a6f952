"""A PyTorch Lightning job that leaves process discovery to Lightning's own SLURM detection.

Launched with the `srun` launcher (one task per rank; slurm/jobs/lightning.yaml), Lightning sees
SLURM_NTASKS and picks its SLURMEnvironment: global rank from SLURM_PROCID, local rank from
SLURM_LOCALID, node rank from SLURM_NODEID, and the rendezvous from MASTER_ADDR/MASTER_PORT, which
the hpkit script exports from the first node's NodeAddr (Lightning would otherwise take the first
node's name, which need not resolve). `--num-nodes` and `--devices` must match the spec's nodes and
tasks_per_node (or gpus_per_node): Lightning checks them against Slurm's counts.

Each rank prints one JSON line; the exit code says whether the DDP replicas stayed identical.
"""

from __future__ import annotations

import argparse
import json
import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hpkit import exit_settle


class TinyRegression(pl.LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    exit_settle.install()  # DDP on gloo: see hpkit.exit_settle
    args = parse_args(argv)
    pl.seed_everything(0, verbose=False)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(data, data.sum(dim=1, keepdim=True))
    model = TinyRegression()
    trainer = pl.Trainer(
        accelerator="auto",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=8))
    weights = model.layer.weight.detach().clone()
    total = trainer.strategy.reduce(weights.clone(), reduce_op="sum")
    in_sync = bool(torch.allclose(total, weights * trainer.world_size))
    record = {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "slurm_procid": os.environ.get("SLURM_PROCID"),
        "node": os.environ.get("SLURMD_NODENAME"),
        "steps": trainer.global_step,
        "in_sync": in_sync,
    }
    print("lightning " + json.dumps(record, sort_keys=True), flush=True)
    return 0 if in_sync else 1


if __name__ == "__main__":
    raise SystemExit(main())
