"""The prerequisite checker: can this node run distributed training, and if not, what to fix.

Each area (Python, PyTorch/CUDA, libstdc++, EFA, IMDS, container mounts, Slurm, storage) has its own
module of small checks that return a Result (hpkit.checks.result). This package uses the standard library
only, so that scripts/check-prereqs.sh can run it on a login node before hpkit (or rich, torch, pydantic) is
installed. This file stays free of imports and of `from __future__` so that even Python 3.6 reaches
__main__'s version guard and gets a FAIL line instead of a SyntaxError.
"""
