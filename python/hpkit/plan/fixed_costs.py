"""What a GPU process holds outside torch's caching allocator: per instance family, in one place.

Neither torch.cuda.max_memory_allocated nor max_memory_reserved counts these, so published runs (which report
one of the two) cannot calibrate them; they are added to what the GPU must hold. Sources: the CUDA context of a
recent driver with torch's kernels (cuBLAS, cuDNN, NCCL) loaded, about 0.5-1 GiB per process on A100/H100
(`nvidia-smi` against max_memory_reserved on the one H100 run in BENCHMARKS.md is the check still to make), and
NCCL's default channel buffers (NCCL_BUFFSIZE 4 MiB x 2 directions x channels x peers: about 0.3-0.6 GiB at
8 GPUs per node). The caching allocator's own reserve is modelled, not taken as a share: hpkit.plan.memory's
`reserve` part.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class FixedCosts:
    cuda_context_bytes: int
    nccl_buffer_bytes: int
    calibrated: bool = False  # True once measured on the family's GPU


# Instance family (the part of the type before the dot, without the ml. prefix) -> its costs.
FAMILIES: dict[str, FixedCosts] = {
    "p4d": FixedCosts(cuda_context_bytes=int(0.75 * GiB), nccl_buffer_bytes=int(0.5 * GiB)),
    "p4de": FixedCosts(cuda_context_bytes=int(0.75 * GiB), nccl_buffer_bytes=int(0.5 * GiB)),
    "p5": FixedCosts(cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB)),
    "p5e": FixedCosts(cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB)),
    "p5en": FixedCosts(cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB)),
    "g5": FixedCosts(cuda_context_bytes=int(0.6 * GiB), nccl_buffer_bytes=int(0.3 * GiB)),
    "g6": FixedCosts(cuda_context_bytes=int(0.6 * GiB), nccl_buffer_bytes=int(0.3 * GiB)),
}
# A GPU family not listed: the largest of the listed costs (an overestimate keeps plans on the safe side).
DEFAULT_GPU = FixedCosts(cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB))
CPU = FixedCosts(cuda_context_bytes=0, nccl_buffer_bytes=0, calibrated=True)


def family_of_instance(instance: str) -> str:
    """`ml.p5.48xlarge` -> `p5`."""
    return instance.removeprefix("ml.").split(".", 1)[0]


def fixed_costs(instance: str | None) -> FixedCosts:
    """The costs of `instance` (None: a CPU run, where there are none)."""
    if instance is None:
        return CPU
    return FAMILIES.get(family_of_instance(instance), DEFAULT_GPU)
