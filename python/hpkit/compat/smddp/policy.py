"""May a job run its "smddp" backend on hpkit's alias, and the one line that says so or why not.

The same decision `hpkit train` makes (hpkit.runtime.parallel.collectives.choose_backend), read from the job's
spec snapshot (HPKIT_SPEC): `collectives.backend: smddp` with `smddp_fallback: false` asks for SageMaker's
library itself, which is not installed wherever this alias is imported, so the job stops. Anything else
(no spec, backend auto, or the fallback allowed) runs on the alias. Torch-free, so a refusal costs no
`import torch`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from hpkit.catalog import smddp_verdict
from hpkit.errors import HpkitError
from hpkit.runtime.config import RunConfig
from hpkit.spec import load_run_config

RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# How long a refusing rank other than 0 waits before it exits. Rank 0 prints why; a rank that exited first made its
# launcher end rank 0 before it had (torchrun and srun stop the others when one fails: seen with warm-forked ranks,
# which reach this check within milliseconds of each other). Rank 0's own exit ends the wait as the launcher stops
# the job, so a refused job still ends as soon as rank 0 has said why.
REFUSAL_WAIT_S = 30.0


@dataclass(frozen=True)
class AliasVerdict:
    allowed: bool
    line: str  # what rank 0 prints: the alias and why, or why the job stops


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank from its launcher (torchrun, srun, mpirun); 0 when started alone."""
    env = os.environ if env is None else env
    for name in RANK_VARIABLES:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def job_config(env: Mapping[str, str] | None = None) -> RunConfig | None:
    """The job's spec snapshot, as `hpkit submit` exported it; None for a script started by hand."""
    path = (os.environ if env is None else env).get("HPKIT_SPEC")
    return load_run_config(path) if path else None


def verdict(cfg: RunConfig | None, alias_of: str) -> AliasVerdict:
    """alias_of: "nccl" (CUDA) or "gloo" (CPU), the backend the alias creates process groups with.

    As in hpkit.runtime.parallel.collectives.choose_backend, with the import known to have failed: a spec that
    asks for SMDDP and forbids the fallback stops; everything else runs on the alias.
    """
    instance_type = cfg.instance_type if cfg else None
    # The shim is imported only where no real install exists (hpkit.shim_lookup).
    why = "SMDDP is not installed here"
    if unsupported := smddp_verdict(instance_type):
        why += f", and {unsupported}"
    if cfg is not None and cfg.collectives.backend == "smddp" and not cfg.collectives.smddp_fallback:
        return AliasVerdict(
            False,
            "smdistributed.dataparallel: collectives.smddp_fallback is false, so this job needs SageMaker's "
            f"SMDDP library, but {why}: set collectives.smddp_fallback: true to run on hpkit's alias of "
            f"{alias_of}, or build the image with --build-arg SMDDP_WHEEL_URL=... for a type SMDDP supports",
        )
    return AliasVerdict(
        True,
        f"smdistributed.dataparallel: backend \"smddp\" is hpkit's alias of {alias_of}, not SageMaker's SMDDP "
        f"library: {why}",
    )


def check(alias_of: str, env: Mapping[str, str] | None = None) -> None:
    """Print the verdict on rank 0; stop this rank (exit 1) when the alias may not run. Every rank calls it."""
    try:
        cfg = job_config(env)
    except HpkitError as exc:
        cfg = None
        if launch_rank(env) == 0:
            print(f"smdistributed.dataparallel: warning: cannot read HPKIT_SPEC ({exc})", flush=True)
    result = verdict(cfg, alias_of)
    if launch_rank(env) == 0:
        print(result.line, flush=True)
    if not result.allowed:
        if launch_rank(env) != 0:
            time.sleep(REFUSAL_WAIT_S)
        raise SystemExit(1)
