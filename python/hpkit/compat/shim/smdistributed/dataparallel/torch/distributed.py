"""SMDDP's first PyTorch API (`import smdistributed.dataparallel.torch.distributed as dist`), on torch's.

torch.distributed's public functions, with init_process_group defaulting to the "smddp" backend (hpkit's
alias) and SMDDP's node-local queries.
"""

import os as _os

import torch.distributed as _dist
from torch.distributed.distributed_c10d import *  # noqa: F403 - the public torch.distributed API, as SMDDP's

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401 - registers the "smddp" backend


def init_process_group(backend="smddp", *args, **kwargs):
    """SMDDP's call takes no arguments; torchrun's or srun's variables say who is who (env://)."""
    return _dist.init_process_group(backend, *args, **kwargs)


def get_local_rank():
    return int(_os.environ.get("LOCAL_RANK", _os.environ.get("SLURM_LOCALID", "0")))


def get_local_size():
    # hpkit's rule (a step's tasks inherit the allocation's SLURM_NTASKS_PER_NODE, which need not be the step's).
    from hpkit.runtime.env import local_world_size

    return local_world_size(_os.environ)
