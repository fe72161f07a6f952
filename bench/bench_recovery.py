"""Recovery after a lost node: a spare inside the job (hpkit.supervise) vs Slurm's requeue, side by side.

On a private 3-node local cluster (SlurmdTimeout 30 s), the same 2-node training job loses a node at its first
checkpoint commit, each way: with `resilience.spare_nodes: 1` (the supervisor probes, swaps in the spare and
restarts the step in the allocation) and without (slurmctld declares the node DOWN and requeues the job). The
clock runs from the kill to the first step the resumed run logs. Then a rank killed with SIGKILL in a job
without restarts: the seconds until the job has ended (the survivors must not wait out a collective timeout).
Then in-memory checkpoints (`checkpoint.memory`) against persistent ones, side by side, with the run held after
step 15 (persistent checkpoint: step 10) and each fault of --faults: rank 0's node lost ("node") or rank 0's process
alone SIGKILLed ("rank"), or rank 0's node with its partner's memory ("partners": both copies lost, the memory sides
fall back to checkpoint.dir), or rank 0's node's link cut ("cut": on a NET=netns cluster, not held: the link goes
down once every rank has finished step 15, and the run trains on until it does). Each part of the recovery in
seconds (PARTS: detect, stop, probe and swap, srun and the agents, import, rendezvous and group, model, in-memory
tier, restore and its source, first step, steps redone), from the supervisor's events and the resumed run's start
record (`phases`). --model runs them at another shape; --sides adds "warm": in-memory checkpoints with
resilience.warm_start (the restarted ranks forked by each node's zygote, so "python + hpkit + torch import" is the
cold sides' part it removes), and "stay": warm with resilience.keep_survivors (the survivor's process taken over
by the restarted step; the rank held is then the lost node's, and the survivor waits in a collective).

Targets (they were assertions in tests/integration/test_node_loss.py and test_resilience.py; the tests keep
the events): spare <= 30 s and below SlurmdTimeout; spare / requeue <= 0.5; killed rank -> end < 45 s.

    python3 bench/bench_recovery.py [--rounds 1] [--only spare,killed,held] [--faults node,rank,partners,cut] [--model 125M]
        [--sides memory,persistent,warm,stay]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "python"), str(REPO / "tests"), str(REPO / "tests" / "integration")]

from test_node_loss import (  # noqa: E402  (the scenarios are the integration tests')
    MEMORY_STEP,
    RECOVERY_MARKS,
    SLURMD_TIMEOUT_S,
    job_processes_on,
    lose_node_held_after_memory_step,
    memory_spec,
    memory_step_complete,
    recovery_timeline,
    requeue_after_node_loss,
    spare_after_node_loss,
    steps_of_run,
)
from test_node_network import CUT_HANG  # noqa: E402
from test_resilience import (  # noqa: E402
    events_of,
    job_events,
    job_log,
    losses,
    submit,
    training_spec,
    wait_for,
)

from hpkit import devcluster  # noqa: E402
from hpkit.runtime.checkpoints.memory_layout import ROOT_ENV  # noqa: E402
from hpkit.runtime.watchdog.hang_board import node_local_base  # noqa: E402
from hpkit.slurm import CliBackend, JobState  # noqa: E402

STEPS = 60


def reference(env: dict[str, str], work: Path) -> dict[int, float]:
    work.mkdir()
    job = submit(training_spec("reference", work, STEPS, interval=1000), work, env)
    wait_for(lambda: CliBackend().info(job).state.finished, 300, "the reference job")
    return losses(work / "reference.jsonl")


def killed_rank_s(env: dict[str, str], work: Path) -> float:
    """Seconds from a SIGKILLed rank to the end of its job (max_restarts 0, collective timeout 30 s)."""
    work.mkdir()
    spec = training_spec("killed", work, 150, interval=20, launcher="srun")
    spec["resilience"]["max_restarts"] = 0
    job = submit(spec, work, env)
    wait_for(lambda: max(losses(work / "killed.jsonl"), default=0) >= 5, 240, "the first steps")
    pids = subprocess.run(["scontrol", "listpids", job], env=env, capture_output=True, text=True).stdout
    for line in pids.splitlines()[1:]:
        pid = line.split()[0]
        cmdline = (
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if Path(f"/proc/{pid}").exists() else []
        )
        if cmdline and Path(cmdline[0].decode()).name.startswith("python") and b"train" in cmdline:
            killed = time.monotonic()
            os.kill(int(pid), 9)
            break
    else:
        raise RuntimeError(f"no training rank of job {job}")
    info = wait_for(lambda: (i := CliBackend().info(job)).state.finished and i, 120, "the job to end")
    assert info.state in (JobState.FAILED, JobState.CANCELLED), info.state
    return time.monotonic() - killed


# A cut link gets no hold: a rank sleeping before a step (the held drills') would be the hang the watchdog names,
# not the cut node, since no socket closes when a link goes down. The run trains on, and the link is cut on an event
# read from its files: every rank has finished step MEMORY_STEP (its in-memory copy complete on both nodes; without
# checkpoint.memory, the step logged); the steps it redoes are the ones the cut really lost. Room past the cut for the
# steps trained before it lands and the resumed run's.
CUT_STEPS = MEMORY_STEP + 25
# No rank finishes a step once the link is down (the survivor waits in a collective with the cut node's rank): the
# hang watchdog, with test_node_network's cut-link limits, stops the step; the collective timeout is far above them
# (six times the held drills'), so that it is not the one measured.
CUT_COLLECTIVE_TIMEOUT_S = 120


def rank0_node(job: str, nodes: list[str], node_memory: Path) -> str:
    """Rank 0's node: from the in-memory copy of MEMORY_STEP (its ranks.json lists every rank's node), else (no
    checkpoint.memory: cold ranks) the node of the process whose environment torchrun gave RANK=0."""
    for ranks in node_memory.glob(f"hpkit-mem-*/*/*/step-{MEMORY_STEP:08d}/ranks.json"):
        return json.loads(ranks.read_text())[0]
    for node in nodes:
        for pid in job_processes_on(job, node):
            with contextlib.suppress(OSError):
                if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return node
    raise RuntimeError(f"no rank 0 of job {job} on {', '.join(nodes)}")


def cut_link_after_memory_step(
    env: dict[str, str],
    work: Path,
    name: str,
    memory: bool,
    model: dict | None,
    warm: bool,
    node_memory: Path,
    keep_survivors: bool = False,
) -> dict[str, Any]:
    """The held drill's run (test_node_loss.memory_spec: 2 step nodes and a spare), not held: rank 0's node's link
    cut (devcluster.cut) once every rank has finished MEMORY_STEP, brought back once the job has ended. Returns
    the recovery's timeline (test_node_loss.recovery_timeline, "new_step" being the first step past the last the
    cut run trained), with what detected the fault, or how the job ended unrecovered."""
    backend = CliBackend()
    work.mkdir()
    spec, extra = memory_spec(name, work, node_memory)
    del extra["HPKIT_FAULT"]  # no hold (above)
    spec["train"]["steps"] = CUT_STEPS
    spec["resilience"].update(collective_timeout_s=CUT_COLLECTIVE_TIMEOUT_S, hang=CUT_HANG)
    patience = 1.0
    if model is not None:
        # test_node_loss's larger-model settings: steps and copies of tens of seconds under load.
        spec["model"] = model
        spec["train"]["steps"] = MEMORY_STEP + 5
        spec["resilience"].update(collective_timeout_s=600, hang={**CUT_HANG, "min_s": 300})
        patience = 5.0
    if not memory:
        del spec["checkpoint"]["memory"]
    spec["resilience"]["warm_start"] = warm
    # As asked, not the default (on for warm CPU ranks): the warm side is the restart it is measured against.
    spec["resilience"]["keep_survivors"] = keep_survivors
    job = submit(spec, work, {**env, **extra})
    metrics = work / f"{name}.jsonl"
    placed = wait_for(
        lambda: events_of(job_events(work / "logs", job), "run_started"), 240, "the run to start"
    )
    nodes = list(placed[0]["step_nodes"])
    past = (
        (lambda: memory_step_complete(node_memory, MEMORY_STEP, nodes))
        if memory
        else (lambda: MEMORY_STEP in losses(metrics))
    )
    asked = {"at": 0.0}

    def reached() -> bool:
        # The files are read twenty times a second, Slurm asked every two (a call takes seconds under load).
        if past():
            return True
        if time.monotonic() - asked["at"] >= 2.0:
            asked["at"] = time.monotonic()
            return backend.info(job).state.finished
        return False

    wait_for(reached, 300 * patience, f"every rank past step {MEMORY_STEP}", poll=0.05)
    if not past():  # the job ended before the cut: no recovery to measure (the bench says how it ended)
        ended = events_of(job_events(work / "logs", job), "end")
        return {"before_cut": ended[-1]["outcome"] if ended else str(backend.info(job).state)}
    cut = rank0_node(job, nodes, node_memory)
    devcluster.cut(env, cut)
    cut_wall = time.time()
    # For a kept folder read again later: the timeline's zero.
    (work / "cut.json").write_text(json.dumps({"node": cut, "time": cut_wall}))
    try:
        info = wait_for(
            lambda: (i := backend.info(job)).state.finished and i, 300 * patience, "the job to end"
        )
    finally:
        devcluster.restore(env, cut)
    events = job_events(work / "logs", job)
    if info.state != JobState.COMPLETED or not events_of(events, "spare_swap"):
        ended = events_of(events, "end")
        print(job_log(info)[-4000:])
        return {
            "ended": (ended[-1]["time"] if ended else time.time()) - cut_wall,
            "outcome": ended[-1]["outcome"] if ended else str(info.state),
        }
    swaps = [e["node"] for e in events_of(events, "spare_swap")]
    assert swaps == [cut], f"swapped {swaps}, cut {cut}"
    trained = max(steps_of_run(metrics, 1))
    timeline = recovery_timeline(events, metrics, cut_wall, past=trained)
    failing = events_of(events, "step_failing")[0]
    timeline["detected_by"] = (
        "hang watchdog"
        if failing["verdict"]
        else "a rank that stays"
        if failing.get("stays")
        else "task exit " + ",".join(str(t["exit_code"]) for t in failing["tasks"])
    )
    timeline["trained"] = trained
    return timeline


# A recovery's parts: each from the mark before it (the first from the fault) to its own mark (test_node_loss's
# RECOVERY_MARKS), named as the issue names them.
PARTS = {
    "detected": "detect (fault -> a task's exit or a hang verdict)",
    "stopped": "stop (grace, step killed)",
    "swapped": "probe + spare swap",
    "step_started": "restart bookkeeping -> srun again",
    "process": "srun + torchrun agent + its rendezvous -> rank 0's process",
    "imported": "python + hpkit + torch import",
    "group": "rendezvous + process group",
    "trainer": "model + FSDP built",
    "memory": "in-memory tier's group",
    "restored": "state restored",
    "resumed": "-> start record",
    "first_step": "first step",
    "new_step": "steps redone",
}
SCENARIOS = ("spare", "killed", "held")
FAULTS = ("node", "rank")  # the default --faults
# "partners": rank 0's node lost with its partner's memory wiped, so both copies of rank 0's state are gone: the
# memory sides fall back to checkpoint.dir (the fallback fault), measured against the plain persistent side.
# "cut": rank 0's node's link cut, not held (cut_link_after_memory_step); the cluster is a NET=netns one then.
ALL_FAULTS = (*FAULTS, "partners", "cut")
SIDES = ("memory", "persistent", "warm", "stay")


def parts(timeline: dict[str, float]) -> dict[str, float]:
    """Each part's seconds from a timeline of marks (seconds after the fault); a mark the run did not write
    (the in-memory tier's, without one) adds its part to the next."""
    out, before = {}, 0.0
    for mark in RECOVERY_MARKS:
        if mark in timeline:
            out[mark] = timeline[mark] - before
            before = timeline[mark]
        else:
            out[mark] = 0.0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", default="7747")
    parser.add_argument("--first-job-id", default="24000")
    parser.add_argument(
        "--only",
        default=",".join(SCENARIOS),
        help="comma-separated subset of spare (spare vs requeue), killed (a rank killed, no restarts), held "
        "(memory vs persistent, each fault of --faults)",
    )
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="the held scenarios' faults: node, rank, partners (a node and its partner's memory: the fallback), "
        "cut (rank 0's node's link cut, not held; the whole bench then runs on a NET=netns cluster)",
    )
    parser.add_argument(
        "--sides",
        default="memory,persistent",
        help="the held scenarios' sides, run in turn: memory (checkpoint.memory), persistent (checkpoint.dir "
        "only), warm (checkpoint.memory and resilience.warm_start: ranks forked by each node's zygote), stay (warm "
        "and resilience.keep_survivors: the survivors' processes taken over by the restarted step)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the held scenarios' model, a shape name (125M: the issue's target size; default: the drills' tiny one)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the jobs' folders (logs, events) and say where"
    )
    args = parser.parse_args()
    only, faults = set(args.only.split(",")), [f for f in args.faults.split(",") if f]
    side_names = [s for s in args.sides.split(",") if s]
    if unknown := set(side_names) - set(SIDES):
        parser.error(f"--sides: {', '.join(sorted(unknown))} unknown; choose from {', '.join(SIDES)}")
    if unknown := set(faults) - set(ALL_FAULTS):
        parser.error(f"--faults: {', '.join(sorted(unknown))} unknown; choose from {', '.join(ALL_FAULTS)}")
    spare, requeue, killed = [], [], []
    held: dict[tuple[str, str], list[dict[str, Any]]] = {}
    keep = tempfile.mkdtemp(prefix="hpkit-bench-recovery-") if args.keep else None
    with (
        contextlib.nullcontext(keep)
        if keep
        else tempfile.TemporaryDirectory(prefix="hpkit-bench-recovery-") as tmp
    ):
        work = Path(tmp)
        env = devcluster.client_env(
            work / "cluster",
            args.port,
            args.first_job_id,
            nodes=3,
            slurmd_timeout=SLURMD_TIMEOUT_S,
            # devcluster.cut needs a link per node to take down
            net="netns" if "cut" in faults and "held" in only else "loopback",
        )
        env.update(TMPDIR=str(work), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
        saved = os.environ.get("SLURM_CONF")
        with devcluster.running(env):
            os.environ["SLURM_CONF"] = env["SLURM_CONF"]  # CliBackend asks the cluster SLURM_CONF names
            try:
                ref = reference(env, work / "reference") if "spare" in only else {}
                for n in range(args.rounds):  # alternating which path goes first
                    paths = [("spare", spare), ("requeue", requeue)]
                    for name, out in (paths if n % 2 == 0 else paths[::-1]) if "spare" in only else []:
                        run = spare_after_node_loss if name == "spare" else requeue_after_node_loss
                        where = work / f"{name}-{n}"
                        out.append(
                            run(env, ref, where) if name == "spare" else run(env, ref, where, "worker")
                        )
                    if "killed" in only:
                        killed.append(killed_rank_s(env, work / f"killed-{n}"))
                    # Rank 0's node lost (or its process killed) with the run held after MEMORY_STEP: restored
                    # from checkpoint.dir (step 10: steps redone) vs from memory (the partner's copy), in turn.
                    for fault in faults if "held" in only else []:
                        for side in side_names if n % 2 == 0 else side_names[::-1]:
                            # The nodes' memory on tmpfs, as on a real node: on this disk (the tests' default)
                            # every copy and restore went through ext4's page cache and writeback.
                            with tempfile.TemporaryDirectory(
                                prefix="hpkit-bench-mem-", dir=node_local_base(None, ROOT_ENV)
                            ) as mem:
                                if fault == "cut":
                                    held.setdefault((fault, side), []).append(
                                        cut_link_after_memory_step(
                                            env,
                                            work / f"held-{fault}-{side}-{n}",
                                            f"held{fault}{side}",
                                            memory=side != "persistent",
                                            model={"name": args.model, "seq_len": 64} if args.model else None,
                                            warm=side in ("warm", "stay"),
                                            node_memory=Path(mem),
                                            keep_survivors=side == "stay",
                                        )
                                    )
                                    continue
                                *_, timeline = lose_node_held_after_memory_step(
                                    env,
                                    work / f"held-{fault}-{side}-{n}",
                                    f"held{fault}{side}",
                                    wipe_partner=fault == "partners",
                                    memory=side != "persistent",
                                    fault="node" if fault == "partners" else fault,
                                    model={"name": args.model, "seq_len": 64} if args.model else None,
                                    warm=side in ("warm", "stay"),
                                    node_memory=Path(mem),
                                    keep_survivors=side == "stay",
                                )
                            held.setdefault((fault, side), []).append(timeline)
            finally:
                if saved is None:
                    os.environ.pop("SLURM_CONF", None)
                else:
                    os.environ["SLURM_CONF"] = saved
    if spare:
        s, r = statistics.median(spare), statistics.median(requeue)
        print(f"TIME recovery_spare_s = {s:.1f} (target <= 30 and < SlurmdTimeout {SLURMD_TIMEOUT_S})")
        print(f"TIME recovery_requeue_s = {r:.1f}")
        print(f"RATIO recovery spare/requeue = {s / r:.2f} (target <= 0.5)")
    if killed:
        k = statistics.median(killed)
        print(f"TIME killed_rank_to_end_s = {k:.1f} (target < 45: collective timeout 30 s + 15)")
    if keep:
        print(f"the jobs' folders are kept in {keep}")
    for (fault, side), timelines in held.items():
        # A run that failed before its fault (a cut comes on an event, and the job may end first): not a
        # recovery, left out of the table.
        for t in [t for t in timelines if "before_cut" in t]:
            print(f"recovery, {fault} ({side}): a run ended before the fault ({t['before_cut']}); left out")
        timelines[:] = [t for t in timelines if "before_cut" not in t]
    for fault in dict.fromkeys(f for (f, _), ts in held.items() if ts):
        unrecovered = [
            (side, t) for (f, side), ts in held.items() if f == fault for t in ts if "outcome" in t
        ]
        for side, t in unrecovered:
            print(
                f"recovery, rank 0's {fault} lost ({side}): not recovered: the job ended {t['ended']:.1f} s later, {t['outcome']}"
            )
        if unrecovered:
            continue
        sides = {side: timelines for (f, side), timelines in held.items() if f == fault and timelines}
        model = args.model or "the drills' tiny model"
        what = (
            f"rank 0's node's link cut once every rank had finished step {MEMORY_STEP} (NET=netns)"
            if fault == "cut"
            else f"rank 0's {fault} lost after step {MEMORY_STEP}"
        )
        print(f"recovery, {what}, {model}: seconds per part (medians)")
        print(f"  {'part':<60}" + "".join(f"{side:>12}" for side in sides))
        split = {side: [parts(t) for t in timelines] for side, timelines in sides.items()}
        for mark in RECOVERY_MARKS:
            print(
                f"  {PARTS[mark]:<60}"
                + "".join(f"{statistics.median(p[mark] for p in ps):>12.1f}" for ps in split.values())
            )
        past = "the last step trained before the cut" if fault == "cut" else str(MEMORY_STEP)
        print(
            f"  {'total: fault -> first step past ' + past:<60}"
            + "".join(f"{statistics.median(t['new_step'] for t in ts):>12.1f}" for ts in sides.values())
        )
        print("  restored from: " + "; ".join(f"{side} {ts[0]['source']}" for side, ts in sides.items()))
        print(
            "  each round's total: "
            + "; ".join(
                f"{side} " + ", ".join(f"{t['new_step']:.1f}" for t in ts) for side, ts in sides.items()
            )
        )
        if fault == "cut":  # not held: where each run was when the link went down, and what saw it
            print(
                "  trained before the cut, detected by: "
                + "; ".join(
                    f"{side} " + ", ".join(f"step {t['trained']} ({t['detected_by']})" for t in ts)
                    for side, ts in sides.items()
                )
            )
        if {"memory", "persistent"} <= set(sides):
            p, m = (statistics.median(t["new_step"] for t in sides[s]) for s in ("persistent", "memory"))
            # Both copies lost: the memory side falls back to checkpoint.dir, and the most it can do is cost no more.
            target = "target <= 1.0: the fallback" if fault == "partners" else "target <= 0.5"
            print(
                f"RATIO recovery_{fault} memory/persistent (fault -> first new step) = {m / p:.2f} ({target})"
            )
        if "stay" in sides:
            print(
                "  ranks that stayed in their processes: "
                + ", ".join(str(t.get("stayed")) for t in sides["stay"])
            )
            if "warm" in sides:
                w, k = (statistics.median(t["new_step"] for t in sides[s]) for s in ("warm", "stay"))
                print(f"RATIO recovery_{fault} stay/warm (fault -> first new step) = {k / w:.2f}")
        for cold in ("persistent", "memory"):
            if {"warm", cold} <= set(sides):
                c, w = (statistics.median(t["new_step"] for t in sides[s]) for s in (cold, "warm"))
                print(f"RATIO recovery_{fault} warm/{cold} (fault -> first new step) = {w / c:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
