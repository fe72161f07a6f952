#!/usr/bin/env bash
# Check whether this node can run distributed training, before hpkit is installed anywhere.
#
# Runs the checker straight from this checkout with the standard library alone (no venv, rich, torch),
# so it works on a fresh login node. Same options and exit status as `hpkit check`:
#   scripts/check-prereqs.sh                      # login profile (Slurm, pyxis, enroot, FSx, IMDSv2, disk)
#   srun -N1 scripts/check-prereqs.sh --profile compute
#   scripts/check-prereqs.sh --json --skip imds
# PYTHON picks the interpreter (default: python3); pass the training venv's python to check that one.
set -euo pipefail

# Resolve symlinks: people link this into ~/bin.
here="$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")"
package_root="$(cd -- "${here}/../python" && pwd -P)"
python="${PYTHON:-python3}"

if ! command -v "${python}" >/dev/null 2>&1; then
  echo "check-prereqs.sh: ${python} not found; install Python ≥ 3.10 or set PYTHON=/path/to/python3" >&2
  exit 1
fi

# The checkout goes first on the path so that an older installed hpkit cannot shadow it.
export PYTHONPATH="${package_root}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${python}" -m hpkit.commands.prereqs "$@"
