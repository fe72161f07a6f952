"""The instance catalog: what each GPU instance type has (GPUs, EFA interfaces) and whether SMDDP supports it.

One table that the checker, the SageMaker importer and the runtime all read. Torch-free and import-light.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceSpec:
    gpus: int
    gpu: str
    efa_devices: int
    smddp: bool = False  # SageMaker's data-parallel library supports only these


# EC2 names; HyperPod and SageMaker spell the same types with an "ml." prefix (see normalise()).
INSTANCE_TYPES: dict[str, InstanceSpec] = {
    "p4d.24xlarge": InstanceSpec(8, "A100 40GB", 4, smddp=True),
    "p4de.24xlarge": InstanceSpec(8, "A100 80GB", 4, smddp=True),
    "p5.48xlarge": InstanceSpec(8, "H100 80GB", 32),
    "p5e.48xlarge": InstanceSpec(8, "H200 141GB", 32),
    "p5en.48xlarge": InstanceSpec(8, "H200 141GB", 16),
    "p6-b200.48xlarge": InstanceSpec(8, "B200", 8),
    "g5.8xlarge": InstanceSpec(1, "A10G", 1),
    "g5.12xlarge": InstanceSpec(4, "A10G", 1),
    "g5.16xlarge": InstanceSpec(1, "A10G", 1),
    "g5.24xlarge": InstanceSpec(4, "A10G", 1),
    "g5.48xlarge": InstanceSpec(8, "A10G", 1),
}

SMDDP_TYPES = tuple(f"ml.{name}" for name, spec in INSTANCE_TYPES.items() if spec.smddp)


def normalise(instance_type: str) -> str:
    name = instance_type.strip().lower()
    return name[3:] if name.startswith("ml.") else name


def lookup(instance_type: str | None) -> InstanceSpec | None:
    return INSTANCE_TYPES.get(normalise(instance_type)) if instance_type else None
