"""`python3 -m hpkit.supervise --plan JSON --step TEXT [--usr1-flag PATH] -- SRUN_OPTIONS...`: the batch
script's supervisor (hpkit.supervise.machine). Its exit status is the job script's."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from hpkit.supervise.cluster import SlurmCli
from hpkit.supervise.machine import Supervisor
from hpkit.supervise.plan import Plan, Run
from hpkit.supervise.watch import serve_watch_store


def log_sizes() -> dict[str, int]:
    """The size of each log file this process writes to (its stdout, stderr): where a step's lines start."""
    sizes = {}
    for fd in (1, 2):
        try:
            path = os.path.realpath(f"/proc/self/fd/{fd}")
            if os.path.isfile(path):
                sizes[path] = os.stat(path).st_size
        except OSError:
            continue
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpkit.supervise")
    parser.add_argument("--plan", required=True, help="the restart policy, as JSON (hpkit.render)")
    parser.add_argument(
        "--step", required=True, help="the launch command after srun's options, as shell text"
    )
    parser.add_argument("--usr1-flag", type=Path, help="a file the batch shell creates when USR1 reaches it")
    parser.add_argument("srun_options", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def say(text: str) -> None:
        print(text, flush=True)

    supervisor = Supervisor(
        Plan.from_json(args.plan),
        Run.from_env(os.environ),
        SlurmCli(),
        args.srun_options,
        args.step,
        os.environ,
        say=say,
        usr1_flag=args.usr1_flag,
    )
    supervisor.logs = log_sizes

    def on_usr1(_signum: int, _frame: Any) -> None:
        supervisor.on_usr1()

    signal.signal(signal.SIGUSR1, on_usr1)
    supervisor._check_flag()  # a USR1 that came before the handler was in place
    store = serve_watch_store(supervisor)  # kept alive for the job's length
    try:
        return supervisor.run()
    finally:
        del store


if __name__ == "__main__":
    sys.exit(main())
