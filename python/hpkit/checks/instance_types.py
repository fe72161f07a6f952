"""The instance-type check: this host's type (from the metadata service) against hpkit's catalog.

GPU and EFA checks compare what they find with the catalog row when the metadata service names the type.
"""

from __future__ import annotations

from hpkit.catalog import SMDDP_TYPES, InstanceSpec, lookup
from hpkit.checks.context import Context
from hpkit.checks.registry import check
from hpkit.checks.result import Result


def expected_for(ctx: Context) -> tuple[str | None, InstanceSpec | None]:
    """This host's instance type (from the metadata service, shared with the imds check) and its row."""
    from hpkit.checks.imds import probe_for

    probe = probe_for(ctx)
    return probe.instance_type, lookup(probe.instance_type)


@check("instance-type", "Instance type supported", profiles=("compute", "container"))
def instance_type(ctx: Context) -> Result:
    from hpkit.checks.imds import probe_for

    probe = probe_for(ctx)
    return _instance_verdict(probe.instance_type).with_facts(instance_type=probe.instance_type)


def _instance_verdict(instance_type: str | None) -> Result:
    if instance_type is None:
        return Result.skip(
            "instance type unknown: the metadata service did not give it (see the imds check)",
            "fix the imds finding; the instance type comes from it",
        )
    spec = lookup(instance_type)
    supported = ", ".join(SMDDP_TYPES)
    if spec is None or not spec.is_gpu:
        return Result.warn(
            f"{instance_type} is not a GPU training type hpkit knows",
            f"train on a GPU type with EFA; SageMaker's data-parallel library supports {supported}",
        )
    shown = f"{instance_type}: {spec.gpus} × {spec.gpu} {spec.gpu_memory_gib} GB, {spec.efa_devices} EFA"
    if spec.smddp:
        return Result.ok(shown)
    return Result.warn(
        f"{shown}; SageMaker's data-parallel library (SMDDP) supports only {supported}",
        "use PyTorch's NCCL backend with aws-ofi-nccl on this type (hpkit's default), or move to "
        f"{supported} if you need SMDDP",
    )
