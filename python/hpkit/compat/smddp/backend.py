"""Register "smddp" with torch.distributed as an alias: NCCL process groups on CUDA, gloo on CPU.

torch's own registration API (Backend.register_backend) is used, so `init_process_group("smddp")`,
`new_group`, DeviceMesh and Lightning's DDPStrategy(process_group_backend="smddp") all create their
groups through `_create`, which builds exactly what `backend="nccl"` (or "gloo") would have built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpkit import exit_settle

NAME = "smddp"


def alias_target() -> str:
    """What real SMDDP is for (NCCL on CUDA), and gloo where there is no GPU: decided by the machine."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _create(opts, backend_options):
    """torch calls this (extended API) for every group made with the "smddp" backend."""
    if alias_target() == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = (
            backend_options
            if isinstance(backend_options, ProcessGroupNCCL.Options)
            else ProcessGroupNCCL.Options()
        )
        if options is not backend_options:
            options.is_high_priority_stream = False
        options._timeout = opts.timeout
        options.global_ranks_in_group = opts.global_ranks_in_group
        options.group_name = opts.group_id
        group = ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, options)
    else:
        from torch.distributed import ProcessGroupGloo

        group = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, timeout=opts.timeout)
        group.options.global_ranks_in_group = opts.global_ranks_in_group
        group.options.group_name = opts.group_id
    # torch numbers the collectives of its built-in backends itself, but not those of a plugin's.
    group._set_sequence_number_for_group()
    return group


def register() -> bool:
    """Register the alias once per process; False when "smddp" was already registered (by anyone)."""
    if NAME.upper() in dist.Backend._plugins:
        return False
    # One device type, as NCCL (cuda) or gloo (cpu) would have: tensors on the other one fail as they
    # would with that backend, instead of silently taking another path.
    device = {"nccl": "cuda", "gloo": "cpu"}[alias_target()]
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=[device])
    exit_settle.install()
    return True
