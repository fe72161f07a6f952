"""Which backend a GPU job's collectives run on: SMDDP (SageMaker's data-parallel library) or NCCL, and why.

Torch-free at import: the decision is a pure function of (what the spec asks, whether SMDDP imported,
the instance type's row in hpkit.catalog), so that it is testable without GPUs; `decide` adds the one
import that registers the "smddp" backend with torch.distributed. Which types SMDDP supports is the
catalog's rule (`catalog.smddp_verdict`), read by the SageMaker importer too, so an imported spec and
the job that runs it agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpkit.catalog import smddp_verdict
from hpkit.shim_lookup import shim_answers

SMDDP_MODULE = "smdistributed.dataparallel.torch.torch_smddp"


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # the torch.distributed backend for GPUs: "smddp" or "nccl"
    reason: str  # one line, for the job's log
    usable: bool  # False: the spec forbids the fallback, so the job must stop with `reason`


def choose_backend(
    requested: str, fallback: bool, import_error: str | None, instance_type: str | None
) -> BackendChoice:
    """requested: the spec's collectives.backend; import_error: None when SMDDP imported, else the error."""
    if requested != "smddp":
        return BackendChoice("nccl", "collectives: NCCL (collectives.backend: auto)", True)
    why_not = smddp_verdict(instance_type)
    if why_not is None and import_error is not None:
        why_not = (
            f"SMDDP is not installed ({import_error}): build the image with --build-arg SMDDP_WHEEL_URL=..."
        )
    if why_not is None:
        where = f" on {instance_type}" if instance_type else " (instance type unknown)"
        return BackendChoice("smddp", f"collectives: SMDDP{where}", True)
    if fallback:
        return BackendChoice("nccl", f"collectives: NCCL, not SMDDP: {why_not}", True)
    return BackendChoice(
        "smddp",
        f"collectives: cannot use SMDDP: {why_not}; set collectives.smddp_fallback: true to run on NCCL",
        False,
    )


def import_smddp() -> str | None:
    """Import SMDDP (which registers the "smddp" backend); None on success, else the error in one line."""
    if shim_answers():
        # compat: [smddp] puts hpkit's alias where SMDDP would be: that is NCCL, not SMDDP.
        return f"ModuleNotFoundError: {SMDDP_MODULE} is not installed: only hpkit's compat alias of it is on the path"
    try:
        __import__(SMDDP_MODULE)
    except Exception as exc:  # a broken install raises more than ImportError (missing libs, CUDA)
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def decide(requested: str, fallback: bool, instance_type: str | None) -> BackendChoice:
    """The runtime's entry point: imports SMDDP only when the spec asks for it and the type allows it."""
    if requested != "smddp" or smddp_verdict(instance_type) is not None:
        return choose_backend(requested, fallback, None, instance_type)
    return choose_backend(requested, fallback, import_smddp(), instance_type)
