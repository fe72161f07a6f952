"""SMDDP's DistributedDataParallel is torch's, over the "smddp" group the script initialised."""

from torch.nn.parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
