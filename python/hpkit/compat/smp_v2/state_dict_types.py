"""SMP v2's state-dict kinds, on the FSDP2 model: local and sharded are the DTensor shards (both reshard on
load through DCP), full is the whole model gathered."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp.api import StateDictType


class SMStateDictType(enum.Enum):
    SM_LOCAL_STATE_DICT = "local"
    SM_SHARDED_STATE_DICT = "sharded"
    SM_FULL_STATE_DICT = "full"


_TO_FSDP = {
    SMStateDictType.SM_LOCAL_STATE_DICT: StateDictType.SHARDED_STATE_DICT,
    SMStateDictType.SM_SHARDED_STATE_DICT: StateDictType.SHARDED_STATE_DICT,
    SMStateDictType.SM_FULL_STATE_DICT: StateDictType.FULL_STATE_DICT,
}


@contextlib.contextmanager
def sm_state_dict_type(model: nn.Module, kind: SMStateDictType) -> Iterator[None]:
    from hpkit.compat.smp_v2.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.state_dict_type(model, _TO_FSDP[SMStateDictType(kind)]):
        yield
