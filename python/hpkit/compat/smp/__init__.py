"""smdistributed.modelparallel.torch (SMP's PyTorch API, as seed 000 uses it) on hpkit's runtime.

`import smdistributed.modelparallel.torch as smp` resolves here when a job spec lists `compat: [smp]`.
Features with no honest equivalent stop the job with one line naming the torch-native way.
"""

from hpkit.compat.smp.checkpoint import load, resume_from_checkpoint, save, save_checkpoint
from hpkit.compat.smp.model import DistributedModel
from hpkit.compat.smp.optimizer import DistributedOptimizer
from hpkit.compat.smp.step import StepOutput, step
from hpkit.compat.smp.topology import (
    barrier,
    dp_rank,
    dp_size,
    get_dp_process_group,
    get_mp_process_group,
    get_pp_process_group,
    get_rdp_process_group,
    get_tp_process_group,
    get_world_process_group,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from hpkit.compat.smp.tp_marking import set_tensor_parallelism, tensor_parallelism
from hpkit.compat.smp.unsupported import unsupported_call

# SMP calls that have no honest equivalent here; calling one stops the job with the torch-native way.
delay_param_initialization = unsupported_call(
    "smp.delay_param_initialization()",
    "build the model on the meta device, parallelise, then to_empty() and initialise",
)
register_distribution = unsupported_call(
    "smp.nn.utils / smp.register_distribution()",
    "mark nn.Linear/nn.Embedding layers with smp.set_tensor_parallelism instead",
)
partition = unsupported_call(
    "smp.partition()", "drop it: the model is split automatically, balanced by parameter count"
)
set_activation_checkpointing = unsupported_call(
    "smp.set_activation_checkpointing()",
    "wrap the module with torch.distributed.algorithms._checkpoint.checkpoint_wrapper or use torch.utils.checkpoint",
)

__all__ = [
    "DistributedModel",
    "DistributedOptimizer",
    "StepOutput",
    "barrier",
    "delay_param_initialization",
    "dp_rank",
    "dp_size",
    "get_dp_process_group",
    "get_mp_process_group",
    "get_pp_process_group",
    "get_rdp_process_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "load",
    "local_rank",
    "local_size",
    "mp_rank",
    "mp_size",
    "partition",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_rank",
    "rdp_size",
    "register_distribution",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "set_activation_checkpointing",
    "set_tensor_parallelism",
    "size",
    "step",
    "tensor_parallelism",
    "tp_rank",
    "tp_size",
]
