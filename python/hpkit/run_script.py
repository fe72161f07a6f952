"""`python -m hpkit.run_script SCRIPT [ARGS]` (or `-m MODULE [ARGS]`): the user's program, run as `python
SCRIPT ARGS` runs it, with hpkit's exit hook installed first.

Jobs launch users' Python programs through this, so that a DDP script on gloo, unchanged, does not abort
at exit ("terminate called without an active exception": see hpkit.exit_settle). The program sees what it
would see run directly: `__name__ == "__main__"`, its own `__file__`, `sys.argv` starting with its path,
its folder first on sys.path; its exit status, SystemExit and uncaught exceptions are its own.
With HPKIT_LINE_LABEL=1 (torchrun jobs, whose ranks share their node's output pipe) each line the rank
writes reaches the log whole and prefixed with its rank, as `srun --label` does (hpkit.line_label).
With HPKIT_PRELOAD=module:function[,...] (a compat layer the job opted into, e.g. SMP v2's
`hpkit.compat.smp_v2:install`) each function runs before the program, so that its imports find the layer.
Standard library only besides those two, so it costs nothing at start-up.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

from hpkit import exit_settle, line_label

PRELOAD_ENV = "HPKIT_PRELOAD"
USAGE = "usage: python -m hpkit.run_script SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit(f"hpkit.run_script: nothing to run\n{USAGE}")
    if os.environ.get(line_label.ENV) == "1":
        # Before anything else starts a thread: this forks the reader that labels the rank's lines.
        line_label.route_std_streams(line_label.rank_label(os.environ))
    exit_settle.install()
    preload(os.environ.get(PRELOAD_ENV, ""))
    if argv[0] == "-m":
        # As `python -m MODULE`: the current directory first on sys.path (it already is: this module
        # was run with -m), argv[0] becomes the module's file once runpy has found it.
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    # As `python SCRIPT`: the script's own folder, not ours or the current one, first on sys.path.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def preload(hooks: str) -> None:
    """Run each `module:function` named (by the rendered job, from its compat layers), in order."""
    for hook in filter(None, (h.strip() for h in hooks.split(","))):
        module, _, function = hook.partition(":")
        if not module or not function:
            sys.exit(f"hpkit.run_script: {PRELOAD_ENV}={hooks!r}: each entry must be module:function")
        # Named by the job at run time, not imported here: the compat layers sit above this module.
        getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    main(sys.argv[1:])
