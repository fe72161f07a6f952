"""`python -m hpkit.commands.prereqs`: the checker without the rest of hpkit (scripts/check-prereqs.sh).

An entry point, so it lives with the commands: the checks themselves (hpkit.checks) never import the
command line.
"""

import sys

# Before anything else is imported: on an interpreter this old the checks themselves cannot run, and
# saying so, as the python check would, is the whole answer. (hpkit targets 3.10; this file must not.)
if sys.version_info < (3, 8):  # noqa: UP036
    version = ".".join(map(str, sys.version_info[:3]))
    print(f"FAIL  python  Python {version} at {sys.executable}; hpkit needs ≥ 3.10")
    print("              fix: set PYTHON=/path/to/python3.10-or-newer (or create the venv from one)")
    sys.exit(1)

from hpkit.commands.check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="check-prereqs.sh"))
