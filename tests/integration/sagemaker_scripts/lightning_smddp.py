"""Seed 003's PyTorch Lightning script on SageMaker's data-parallel library, as a SageMaker user has it.

Transcribed from the seed's three steps: import torch_smddp, a LightningEnvironment whose world size and
rank come from WORLD_SIZE and RANK, and DDPStrategy(cluster_environment=env, process_group_backend=
"smddp", accelerator="gpu"); the model is the seed's benchmark model, a multilayer perceptron of seven
dense layers. Changed only where the seed cannot run here: the data is a fixed synthetic set, the
accelerator is the CPU where CUDA is absent, and LightningEnvironment's import path is Lightning 2's.
"""

import argparse
import json
import os

import pytorch_lightning as pl
import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
import torch
import torch.distributed as dist
import weights

# The seed imports it from ...environments.lightning_environment, a module Lightning 2 folded into this one.
from pytorch_lightning.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(pl.LightningModule):
    def __init__(self, width=16, lr=0.05):
        super().__init__()
        layers = []
        for _ in range(6):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))  # seven dense layers
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def on_train_start(self):
        # For the report: Lightning tears its environment down after fit.
        self.process_group = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-gpus", type=int, default=int(os.environ["SM_NUM_GPUS"]))
    parser.add_argument("--hosts", type=list, default=json.loads(os.environ["SM_HOSTS"]))
    parser.add_argument("--output-data-dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    env = LightningEnvironment()
    env.world_size = lambda: int(os.environ["WORLD_SIZE"])
    env.global_rank = lambda: int(os.environ["RANK"])

    cuda = torch.cuda.is_available()
    ddp = DDPStrategy(
        cluster_environment=env, process_group_backend="smddp", accelerator="gpu" if cuda else "cpu"
    )
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())
    model = MLP()
    before = weights.digest(model)
    trainer = pl.Trainer(
        devices=args.num_gpus if cuda else int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=len(args.hosts),
        strategy=ddp,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=args.batch_size))
    weights.report(
        args.output_data_dir,
        trainer.global_rank,
        **model.process_group,
        steps=trainer.global_step,
        before=before,
        after=weights.digest(model),
    )
