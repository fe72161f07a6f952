"""One process of test_stay_in_process: `python stay_layouts.py ROLE CONFIG PORT MEMORY_ROOT`.

plain-0 / plain-1: ranks 0 and 1 of the uninterrupted run (the reference's losses).
victim: rank 0 of the first run, which exits before step 4 (HPKIT_FAULT).
survivor: rank 1 of the first run; its group breaks when the victim goes, and it then runs again in the same
process as rank 0 of the second run (hpkit.runtime.stay's own steps between the two: what a rank that stays
does once its node's next step has taken it over).
spare: rank 1 of the second run, a new process."""

from __future__ import annotations

import os
import sys

role, config, port, memory = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
BASE = dict(os.environ)


def launch(rank: int, attempt: int, node: str, fault: str | None = None) -> None:
    os.environ.clear()
    os.environ.update(BASE)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port + attempt),
        SLURMD_NODENAME=node,
        SLURM_JOB_ID="7",
        HPKIT_STEP_ATTEMPT=str(attempt),
        HPKIT_MEMORY_ROOT=memory,
    )
    if fault:
        os.environ["HPKIT_FAULT"] = fault


def gloo_threads() -> int:
    """This process's threads that a gloo process group runs (its workers and its transport's loop)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sum(1 for name in names if "gloo" in name)


def main() -> int:
    from hpkit.runtime.run import run
    from hpkit.runtime.stay import forget_the_run, group_broke
    from hpkit.spec import load_run_config

    if role.startswith("plain-"):
        launch(int(role[-1]), 0, f"plain{role[-1]}")
        return run(load_run_config(config))
    if role == "victim":
        launch(0, 0, "node-a", "exit:rank=0,step=4")
        return run(load_run_config(config))
    if role == "spare":
        launch(1, 1, "node-c")
        return run(load_run_config(config))
    launch(1, 0, "node-b")
    try:
        run(load_run_config(config))
    except Exception as exc:
        why = group_broke(exc)
        print(f"stays: {why}", flush=True)
        if why is None:
            raise
    else:
        print("stays: the first run did not fail", flush=True)
        return 3
    forget_the_run()
    print(f"threads of the broken group: {gloo_threads()}", flush=True)
    launch(0, 1, "node-b")  # the next step's rank 0 on this node took the process over
    return run(load_run_config(config))


if __name__ == "__main__":
    sys.exit(main())
