"""`torch.sagemaker.distributed.checkpoint.state_dict_utils`: sm_state_dict_type and SMStateDictType."""

from hpkit.compat.smp_v2.state_dict_types import SMStateDictType, sm_state_dict_type

__all__ = ["SMStateDictType", "sm_state_dict_type"]
