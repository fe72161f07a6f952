"""A SageMaker training script, as written for SageMaker: one process per host, its process group built
from SM_HOSTS and SM_CURRENT_HOST, hyperparameters as `--name value` arguments.

It runs unchanged under Slurm with `sagemaker_env` in the job spec (slurm/jobs/sm-hosts.yaml): hpkit
exports the SM_* variables, and MASTER_ADDR/MASTER_PORT for `env://`, as SageMaker's containers do.
Each host prints one JSON line; the exit code says whether the gradients agreed across hosts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int, seed: int = 0):
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return len(self.data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", type=str, default="gloo")
    parser.add_argument("--model-type", type=str, default="custom")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--hosts", type=list, default=json.loads(os.environ["SM_HOSTS"]))
    parser.add_argument("--current-host", type=str, default=os.environ["SM_CURRENT_HOST"])
    parser.add_argument("--model-dir", type=str, default=os.environ["SM_MODEL_DIR"])
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    world_size = len(args.hosts)
    host_rank = args.hosts.index(args.current_host)
    dist.init_process_group(backend=args.backend, rank=host_rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(5, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = RandomDataset(5, 100)
    loader = DataLoader(dataset, batch_size=10, sampler=DistributedSampler(dataset))
    seen = 0
    for _ in range(args.epochs):
        for batch in loader:
            optimizer.zero_grad()
            model(batch).pow(2).mean().backward()
            optimizer.step()
            seen += len(batch)
    # DDP keeps replicas identical: the sum of every host's weights is world_size times each one's.
    weights = model.module.weight.detach().clone()
    total = weights.clone()
    dist.all_reduce(total)
    in_sync = torch.allclose(total, weights * world_size)
    if host_rank == 0:
        Path(args.model_dir).mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), Path(args.model_dir) / "model.pt")
    dist.barrier()
    dist.destroy_process_group()
    channel = os.environ.get("SM_CHANNEL_TRAINING")
    return {
        "hosts": args.hosts,
        "current_host": args.current_host,
        "host_rank": host_rank,
        "world_size": world_size,
        "backend": args.backend,
        "model_type": args.model_type,
        "samples_seen": seen,
        "in_sync": in_sync,
        "num_gpus": os.environ.get("SM_NUM_GPUS"),
        "model_dir": args.model_dir,
        "output_data_dir": os.environ.get("SM_OUTPUT_DATA_DIR"),
        "channels": json.loads(os.environ.get("SM_CHANNELS", "[]")),
        "training_files": sorted(p.name for p in Path(channel).iterdir()) if channel else None,
    }


def main(argv: list[str] | None = None) -> int:
    record = train(parse_args(argv))
    print("sm-hosts " + json.dumps(record, sort_keys=True), flush=True)
    return 0 if record["in_sync"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
