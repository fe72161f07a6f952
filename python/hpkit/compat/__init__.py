"""SageMaker's distributed-training APIs on hpkit's runtime, opt-in per job (`compat: [smp, smddp]`).

A job that opts in gets SHIM_DIR first on its tasks' PYTHONPATH (hpkit.slurm.script). SHIM_DIR holds a top-level
`smdistributed` package whose modules are thin: they re-export hpkit.compat.smp / hpkit.compat.smddp, so
that `import smdistributed.modelparallel.torch as smp` or `import smdistributed.dataparallel.torch.torch_smddp`
runs a SageMaker script unchanged. Where SageMaker's own libraries are installed they win: the shim's
`smdistributed/__init__.py` hands the whole package over to them (hpkit.shim_lookup).
"""

from __future__ import annotations

from pathlib import Path

# A plain folder put on PYTHONPATH, not a package of hpkit: what it holds is imported as `smdistributed`.
SHIM_DIR = Path(__file__).resolve().parent / "shim"


def main() -> int:
    """`python -m hpkit.compat`: print the shim folder, as the rendered script asks the task's own Python."""
    print(SHIM_DIR)
    return 0
