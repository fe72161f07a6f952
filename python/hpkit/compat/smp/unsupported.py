"""SMP features with no honest equivalent here: the job stops with one line naming the feature and the
torch-native way to get it. Parameters that change nothing that matters here only warn."""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import NoReturn

# parameter -> the torch-native way to get what it did
UNSUPPORTED_PARAMETERS: dict[str, str] = {
    "fp16": "drop fp16 (loss-scaled fp16) and use bf16: torch.autocast('cuda', dtype=torch.bfloat16) needs no loss scaling",
    "fp16_params": "drop it and use bf16 through torch.autocast",
    "shard_optimizer_state": "use FSDP2 (torch.distributed.fsdp.fully_shard), which shards optimizer state; hpkit train does with dp_shard",
    "sharded_data_parallel_degree": "use FSDP2 (torch.distributed.fsdp.fully_shard) or hpkit train with parallelism.dp_shard",
    "active_microbatches": "drop it: torch.distributed.pipelining's Schedule1F1B bounds the microbatches in flight itself",
    "optimize": "drop it: the partition here balances parameter counts; choose speed or memory with the pipeline schedule",
    "offload_activations": "use torch.autograd.graph.save_on_cpu() around the forward",
    "activation_loading_horizon": "use torch.autograd.graph.save_on_cpu() around the forward",
    "delayed_parameter_initialization": "build the model on the meta device and call to_empty() + init after parallelising",
    "horovod": "drop it: data parallel here is torch.distributed (ddp: true)",
    "auto_partition": "drop it: the model is always split automatically, balanced by parameter count",
    "default_partition": "drop it: the model is always split automatically, balanced by parameter count",
    "prescaled_batch": "drop it: tensor-parallel ranks here always read the same batch (prescaled_batch true)",
}
# parameter -> why it changes nothing that matters here
IGNORED_PARAMETERS: dict[str, str] = {
    "placement_strategy": "the mesh is always (pp, dp, tp) with tp innermost, so tensor-parallel ranks are neighbours",
    "contiguous": "stages are always contiguous runs of modules",
    "memory_weight": "the partition balances parameter counts",
    "ddp_port": "the process group uses the job's rendezvous",
    "ddp_dist_backend": "the backend is nccl on CUDA and gloo on CPU",
    "tensor_parallel_seed": "every rank builds the model from the same seed; shards are cut from that",
    "skip_tracing": "the model is traced with torch.fx without running it",
}


# Seconds a rank other than 0 waits before exiting on an SmpExit, so that rank 0's line reaches the log.
QUIET_RANK_EXIT_DELAY_S = 3.0


class SmpExit(SystemExit):
    """Stops the job: rank 0 prints the one line (SystemExit prints its message, no traceback), the other
    ranks exit with status 1 silently, so a job log holds the line once."""

    def __init__(self, line: str) -> None:
        super().__init__(line if _is_rank0() else 1)
        self.line = line
        if not _is_rank0():
            # srun --kill-on-bad-exit ends the step at the first rank that exits non-zero: a silent rank
            # that got here first would kill rank 0 before it printed the line (seen on a loaded machine).
            # Every rank reaches the same check, so rank 0 is at most moments behind.
            atexit.register(time.sleep, QUIET_RANK_EXIT_DELAY_S)


def _is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def stop(feature: str, fix: str) -> NoReturn:
    raise SmpExit(f"smp: {feature} is not supported by hpkit's SMP compatibility layer; {fix}")


def bad_setting(line: str) -> NoReturn:
    """A setting every rank evaluates the same way: every rank stops without a collective."""
    raise SmpExit(f"smp: {line}")


def warn_ignored(name: str, value: object) -> None:
    """One line, from rank 0 only (every rank reads the same parameters)."""
    if _is_rank0():
        print(
            f"smp: warning: {name}={value!r} is ignored: {IGNORED_PARAMETERS[name]}",
            file=sys.stderr,
            flush=True,
        )


def unsupported_call(feature: str, fix: str):
    """A stand-in for an SMP function that stops the job when called."""

    def call(*_args, **_kwargs) -> NoReturn:
        stop(feature, fix)

    call.__name__ = feature.rsplit(".", 1)[-1].rstrip("()")
    return call
