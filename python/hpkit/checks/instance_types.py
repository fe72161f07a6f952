"""The one table of GPU instance types: how many GPUs and EFA devices each should show, and which SMDDP supports.

GPU and EFA checks compare what they find with this table when the metadata service names the instance type.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpkit.checks.context import Context
from hpkit.checks.registry import check
from hpkit.checks.result import Result


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


def expected_for(ctx: Context) -> tuple[str | None, InstanceSpec | None]:
    """This host's instance type (from the metadata service, shared with the imds check) and its row."""
    from hpkit.checks.imds import probe_for

    probe = probe_for(ctx)
    return probe.instance_type, lookup(probe.instance_type)


@check("instance-type", "Instance type supported", profiles=("compute", "container"))
def instance_type(ctx: Context) -> Result:
    from hpkit.checks.imds import probe_for

    probe = probe_for(ctx)
    if probe.instance_type is None:
        return Result.skip(
            "instance type unknown: the metadata service did not give it (see the imds check)",
            "fix the imds finding; the instance type comes from it",
        )
    spec = lookup(probe.instance_type)
    supported = ", ".join(SMDDP_TYPES)
    if spec is None:
        return Result.warn(
            f"{probe.instance_type} is not a GPU training type hpkit knows",
            f"train on a GPU type with EFA; SageMaker's data-parallel library supports {supported}",
        )
    shown = f"{probe.instance_type}: {spec.gpus} × {spec.gpu}, {spec.efa_devices} EFA"
    if spec.smddp:
        return Result.ok(shown)
    return Result.warn(
        f"{shown}; SageMaker's data-parallel library (SMDDP) supports only {supported}",
        "use PyTorch's NCCL backend with aws-ofi-nccl on this type (hpkit's default), or move to "
        f"{supported} if you need SMDDP",
    )
