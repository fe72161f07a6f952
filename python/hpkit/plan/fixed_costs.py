"""What only a GPU shows and no formula derives: per instance family, in one place.

Each constant is a guess until a device is lent to calibrate it (tests/integration/test_plan_memory_measured.py
checks the formulas on CPUs, where these costs are zero). Sources of the starting values: the CUDA context
of a recent driver with torch's kernels loaded (about 0.5-1 GiB per process on A100/H100), NCCL's default
channel buffers (NCCL_BUFFSIZE 4 MiB x channels x peers, about 0.3-0.6 GiB at 8 GPUs per node), and the
caching allocator's fragmentation, taken as a share of the dynamic (activation) memory.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class FixedCosts:
    cuda_context_bytes: int
    nccl_buffer_bytes: int
    # The caching allocator's blocks that are reserved but not usable, as a share of the memory that
    # comes and goes within a step (activations, unsharded weights, logits).
    fragmentation: float
    calibrated: bool = False  # True once measured on the family's GPU


# Instance family (the part of the type before the dot, without the ml. prefix) -> its costs.
FAMILIES: dict[str, FixedCosts] = {
    "p4d": FixedCosts(
        cuda_context_bytes=int(0.75 * GiB), nccl_buffer_bytes=int(0.5 * GiB), fragmentation=0.10
    ),
    "p4de": FixedCosts(
        cuda_context_bytes=int(0.75 * GiB), nccl_buffer_bytes=int(0.5 * GiB), fragmentation=0.10
    ),
    "p5": FixedCosts(cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB), fragmentation=0.10),
    "p5e": FixedCosts(
        cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB), fragmentation=0.10
    ),
    "p5en": FixedCosts(
        cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB), fragmentation=0.10
    ),
    "g5": FixedCosts(cuda_context_bytes=int(0.6 * GiB), nccl_buffer_bytes=int(0.3 * GiB), fragmentation=0.10),
    "g6": FixedCosts(cuda_context_bytes=int(0.6 * GiB), nccl_buffer_bytes=int(0.3 * GiB), fragmentation=0.10),
}
# A GPU family not listed: the largest of the listed costs (an overestimate keeps plans on the safe side).
DEFAULT_GPU = FixedCosts(
    cuda_context_bytes=int(1.0 * GiB), nccl_buffer_bytes=int(0.6 * GiB), fragmentation=0.10
)
CPU = FixedCosts(cuda_context_bytes=0, nccl_buffer_bytes=0, fragmentation=0.0, calibrated=True)


def family_of_instance(instance: str) -> str:
    """`ml.p5.48xlarge` -> `p5`."""
    return instance.removeprefix("ml.").split(".", 1)[0]


def fixed_costs(instance: str | None) -> FixedCosts:
    """The costs of `instance` (None: a CPU run, where there are none)."""
    if instance is None:
        return CPU
    return FAMILIES.get(family_of_instance(instance), DEFAULT_GPU)
