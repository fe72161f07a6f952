"""`torch.sagemaker.utils.process_group_utils`."""

from __future__ import annotations

import torch.distributed as dist


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    return dist.get_process_group_ranks(process_group or dist.group.WORLD)
