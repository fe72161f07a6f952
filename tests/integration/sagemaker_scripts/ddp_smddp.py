"""Seed 002's DistributedDataParallel script with SMDDP, as a SageMaker user has it.

Transcribed from the seed (the "pytorch ddp" script and its "SageMaker SDP" change: import torch_smddp,
then `dist.init_process_group(backend="smddp")`): the same RandomDataset, Model, sizes and
hyperparameters. Changed only where the seed cannot run here: the data is a fixed synthetic set (seeded,
with a target so that there is something to learn), the device is the CPU where CUDA is absent, and
the seed's forward-only loop gets a loss and an optimizer step, so that training changes the weights.
"""

import argparse
import json
import os

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
import torch
import torch.distributed as dist
import torch.nn as nn
import weights
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# Parameters and DataLoaders
input_size = 5
output_size = 2
batch_size = 30
data_size = 100


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn(length, size, generator=generator)
        self.target = self.data @ torch.randn(size, output_size, generator=generator)

    def __getitem__(self, index):
        return self.data[index], self.target[index]

    def __len__(self):
        return self.len


class Model(nn.Module):
    # Our model
    def __init__(self, input_size, output_size):
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, input):
        output = self.fc(input)
        print("\tIn Model: input size", input.size(), "output size", output.size())
        return output


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", type=str, default="smddp")
    parser.add_argument("--model-type", type=str, default="custom")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hosts", type=list, default=json.loads(os.environ["SM_HOSTS"]))
    parser.add_argument("--current-host", type=str, default=os.environ["SM_CURRENT_HOST"])
    parser.add_argument("--output-data-dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    print(f"host {args.current_host} of {args.hosts}: rank {rank} of {dist.get_world_size()}")
    # device
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(rank)  # each rank starts differently: DDP's broadcast must make them equal
    model = Model(input_size, output_size).to(device)
    # multiple machine gpus
    model = torch.nn.parallel.DistributedDataParallel(model)
    before = weights.digest(model.module)
    dataset = RandomDataset(input_size, data_size)
    rand_loader = DataLoader(dataset=dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # train
    for epoch in range(args.epochs):
        rand_loader.sampler.set_epoch(epoch)
        for input, target in rand_loader:
            input, target = input.to(device), target.to(device)
            output = model(input)
            print("Outside: input size", input.size(), "output_size", output.size())
            loss = nn.functional.mse_loss(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    weights.report(
        args.output_data_dir,
        rank,
        backend=dist.get_backend(),
        world_size=dist.get_world_size(),
        before=before,
        after=weights.digest(model.module),
    )
    dist.destroy_process_group()
