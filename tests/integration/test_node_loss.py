"""A node lost mid-run on plain Slurm (no HyperPod agent): Slurm requeues the job and it resumes.

The node dies the way a crashed host does: its slurmd, its slurmstepd and the job's tasks on it are
killed together, so slurmctld learns of it only from missed pings (SLURMD_TIMEOUT_S below; the drills
that wait for slurmctld lower it for their own run: `quick_node_death`). The module
has its own three-node cluster, apart from the session's: a dead slurmd would disturb other tests, and
the spare third node lets the requeued job run without the lost one.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _dirwatch import DirWatch
from test_resilience import events_of, job_events, job_log, losses, submit, training_spec, wait_for

from _clusters import slot
from hpkit import devcluster
from hpkit.slurm import CliBackend, JobState

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

# Long enough that a recovery on a spare node, which must not wait for slurmctld to mark the lost node
# DOWN, is told apart from one that does (test_a_lost_node_is_replaced_by_a_spare_inside_the_job): the recovery
# runs before slurmctld acts, as on a real cluster (Slurm's default is 300 s).
SLURMD_TIMEOUT_S = 30
# The requeue drills wait for slurmctld to declare the node DOWN, and nothing they check depends on how long
# that takes: they run with these (`quick_node_death`). slurmctld's ping of a dead slurmd fails only after
# MessageTimeout (20 s on slurm/dev), so the node is DOWN about max(SlurmdTimeout, MessageTimeout) + 7 s after
# its death (measured on a scratch cluster: 17-23 s at 10/5, 25-27 s at 10/20, 37-48 s at 30/20 and 30/5; here at
# 10/10, kill -> requeued 25-28 s against 37-42 s at the module's 30/20).
QUICK_SLURMD_TIMEOUT_S, QUICK_MESSAGE_TIMEOUT_S = 10, 10
COLLECTIVE_TIMEOUT_S = 20


def detection_margin_s(env: dict[str, str]) -> int:
    """slurmctld pings every SlurmdTimeout/3 and declares a silent node DOWN SlurmdTimeout after its last answer
    (its ping of a dead slurmd failing after MessageTimeout); then it requeues the job. Twice the longer of the
    two as the cluster has them now, and room for a loaded machine."""
    conf = Path(env["SLURM_CONF"]).read_text()
    slurmd_s, message_s = (
        int(re.search(rf"(?m)^{key}=(\d+)$", conf).group(1)) for key in ("SlurmdTimeout", "MessageTimeout")
    )
    return 2 * max(slurmd_s, message_s) + 20


STEPS, INTERVAL = 60, 10
# A requeued job may start AuthInfo's cred_expire (20 s, slurm/dev) after its requeue, and it is the backfill
# scheduler's next pass that starts it: Slurm's default 30 s between passes added up to 30 s of idle waiting
# to a requeue here (19 s measured). A pass a second leaves Slurm's own requeue delay (the feature) in place.
BF_INTERVAL_S = 1


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """Three nodes on ports and job ids apart from the session's two-node cluster."""
    env = devcluster.client_env(
        tmp_path_factory.mktemp("slurm-3"),
        *slot("node-loss"),
        nodes=3,
        slurmd_timeout=SLURMD_TIMEOUT_S,
        bf_interval=BF_INTERVAL_S,
    )
    saved = os.environ.get("SLURM_CONF")
    with devcluster.running(env):
        # CliBackend asks the cluster that SLURM_CONF names.
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        try:
            yield env
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


def set_timeouts(env: dict[str, str], slurmd_s: int, message_s: int) -> None:
    """SlurmdTimeout and MessageTimeout of the running cluster, through its slurm.conf and `scontrol reconfigure`
    (slurmctld and every slurmd read them again)."""
    conf = Path(env["SLURM_CONF"])
    text = re.sub(r"(?m)^SlurmdTimeout=\d+$", f"SlurmdTimeout={slurmd_s}", conf.read_text())
    text = re.sub(r"(?m)^MessageTimeout=\d+$", f"MessageTimeout={message_s}", text)
    conf.write_text(text)
    subprocess.run(["scontrol", "reconfigure"], env=env, check=True, capture_output=True)
    shown = subprocess.run(
        ["scontrol", "show", "config"], env=env, check=True, capture_output=True, text=True
    )
    assert re.search(rf"^SlurmdTimeout\s*=\s*{slurmd_s} sec", shown.stdout, re.M), shown.stdout


@pytest.fixture
def quick_node_death(three_nodes):
    """The module's cluster with slurmctld declaring a dead node DOWN in about 20 s instead of 40-50 (see
    QUICK_SLURMD_TIMEOUT_S), for the drills that wait for it; the module's own timeouts again afterwards."""
    message_s = int(
        re.search(r"(?m)^MessageTimeout=(\d+)$", Path(three_nodes["SLURM_CONF"]).read_text()).group(1)
    )
    set_timeouts(three_nodes, QUICK_SLURMD_TIMEOUT_S, QUICK_MESSAGE_TIMEOUT_S)
    try:
        yield three_nodes
    finally:
        set_timeouts(three_nodes, SLURMD_TIMEOUT_S, message_s)


@pytest.fixture(scope="module")
def reference_losses(three_nodes, tmp_path_factory) -> dict[int, float]:
    """An uninterrupted run's losses, run before any node is lost."""
    workdir = tmp_path_factory.mktemp("reference")
    job = submit(training_spec("reference", workdir, STEPS, interval=1000), workdir, three_nodes)
    info = wait_for(lambda: (i := CliBackend().info(job)).state.finished and i, 300, "the reference job")
    assert info.state == JobState.COMPLETED, job_log(info)
    series = losses(workdir / "reference.jsonl")
    # The comparisons below run over this series: an empty or cut one would compare nothing.
    assert sorted(series) == list(range(1, STEPS + 1)), sorted(series)
    return series


def job_fields(job: str, env: dict[str, str]) -> dict[str, str]:
    text = subprocess.run(
        ["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, check=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def job_processes_on(job: str, node: str) -> list[int]:
    """The job's processes on one emulated node, and the slurmstepds that watch them."""
    found: set[int] = set()
    wanted = {f"SLURM_JOB_ID={job}".encode(), f"SLURMD_NODENAME={node}".encode()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not wanted <= set((proc / "environ").read_bytes().split(b"\0")):
                continue
            found.add(int(proc.name))
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if b"slurmstepd" in Path(f"/proc/{parent}/cmdline").read_bytes():
                found.add(parent)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return sorted(found)


def kill_node(env: dict[str, str], job: str, node: str) -> list[int]:
    """What a crashed host does to the job: its slurmd first, so it cannot report its steps' deaths."""
    slurmd = int((Path(env["HPKIT_DEV_CLUSTER_DIR"]) / "run" / f"slurmd-{node}.pid").read_text())
    victims = job_processes_on(job, node)
    os.kill(slurmd, signal.SIGKILL)
    for pid in victims:
        # Gone already: a warm-started rank dies with its zygote (PR_SET_PDEATHSIG), killed just before it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victims


def kill_rank(job: str, node: str, log: Path | None = None) -> list[int]:
    """A rank's process SIGKILLed (the OOM killer, a crash), its node and torchrun's agent there left up. A rank
    forked warm shows the zygote's environment in /proc: its process is the one the job's `log` names, forked for
    rank 0 on `node` (the process found by its environment would be its client, whose death the rank outlives
    with resilience.keep_survivors)."""
    text = log.read_text() if log is not None and log.exists() else ""
    if forked := re.findall(
        rf"warm start on {re.escape(node)}: rank 0 \(attempt 0\) forked as process (\d+)", text
    ):
        os.kill(int(forked[0]), signal.SIGKILL)
        return [int(forked[0])]
    for pid in job_processes_on(job, node):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"LOCAL_RANK=0" in environ and any(v.startswith(b"TORCHELASTIC_RUN_ID=") for v in environ):
                os.kill(pid, signal.SIGKILL)
                return [pid]
    return []


def wait_for_first_commit(ckpt_dir: Path, timeout: float) -> None:
    """Returns when `latest` first appears in `ckpt_dir`: the first checkpoint's commit."""
    deadline = time.monotonic() + timeout
    with DirWatch() as watch:
        assert watch.add(ckpt_dir.parent)
        watching = watch.add(ckpt_dir)
        while time.monotonic() < deadline:
            if (ckpt_dir / "latest").exists():
                return
            for parent, name, _ in watch.events(0.2):
                if parent == ckpt_dir.parent and name == ckpt_dir.name and not watching:
                    watching = watch.add(ckpt_dir)
    pytest.fail(f"no checkpoint committed in {ckpt_dir} after {timeout:.0f} s")


def first_step_after_restart(metrics: Path, starts_before: int) -> dict:
    """The first step record that a run started after the first `starts_before` runs wrote."""
    starts = 0
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            starts += 1
        elif starts > starts_before and "loss" in record:
            return record
    raise AssertionError(f"no step logged by a run after the first {starts_before} in {metrics}")


def starts_in(metrics: Path) -> int:
    return sum(json.loads(line).get("event") == "start" for line in metrics.read_text().splitlines())


def steps_of_run(metrics: Path, run: int) -> set[int]:
    """The steps that the `run`-th run (1: the first) logged, from the lines written whole so far."""
    starts, steps = 0, set()
    for line in metrics.read_text().split("\n")[:-1] if metrics.exists() else []:
        record = json.loads(line)
        starts += record.get("event") == "start"
        if starts == run and "loss" in record:
            steps.add(record["step"])
    return steps


# The batch host's loss takes the batch script with it: only Slurm itself can requeue then. (A worker's loss,
# the batch script left running: test_a_lost_worker_requeues_the_job_it_resumes_and_a_loss_past_the_budget_ends_it.)
def test_a_lost_batch_host_requeues_the_job_and_it_resumes_to_the_same_losses(
    quick_node_death, reference_losses, tmp_path
):
    requeue_after_node_loss(quick_node_death, reference_losses, tmp_path, "batch-host")


# The requeued run of the worker drill loses a worker again when it has logged this step (held in its save).
SECOND_LOSS_STEP = 2 * INTERVAL


def test_a_lost_worker_requeues_the_job_it_resumes_and_a_loss_past_the_budget_ends_it(
    quick_node_death, reference_losses, tmp_path
):
    """max_restarts=1, one job for two drills (the budget drill starts from the state the requeue leaves): a worker
    node (not the batch host: the supervisor sees the step fail) is lost at the first checkpoint commit; Slurm
    requeues the job, which resumes from that checkpoint on the other nodes to the reference losses. Its second run,
    held in its step-20 save, loses a worker too: the budget is spent, so Slurm's requeue is off and Slurm ends the
    job as NODE_FAIL."""
    env, backend = quick_node_death, CliBackend()
    spec = training_spec("lost", tmp_path, STEPS, interval=INTERVAL)
    spec["resilience"].update(max_restarts=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    # Every run's save of step 20 sleeps: the requeued run is held there, steps 11-20 trained and logged, for the
    # second loss (the first run is lost at step 10's commit; were it to reach step 20 first, it would wait there).
    spec["env"] = {"HPKIT_FAULT": f"slow_save:step={SECOND_LOSS_STEP},seconds=3600,attempts=all"}
    job = submit(spec, tmp_path, env)
    metrics = tmp_path / "lost.jsonl"

    wait_for_first_commit(tmp_path / "lost-ckpt", 240)
    fields = job_fields(job, env)
    lost = [next(n for n in hostnames(fields["NodeList"], env) if n != fields["BatchHost"])]
    assert kill_node(env, job, lost[0]), f"no processes of job {job} on {lost[0]}"
    killed_at = time.monotonic()
    try:
        requeued_s, stopped_at = wait_for_requeue(job, env, metrics, killed_at)
        # The event: the requeued run has logged step 20 (and sleeps in its save).
        wait_for(
            lambda: SECOND_LOSS_STEP in steps_of_run(metrics, 2),
            300,
            f"the second run's step {SECOND_LOSS_STEP}",
        )
        fields = job_fields(job, env)
        assert fields["JobState"] == "RUNNING" and fields["Restarts"] == "1", fields
        lost.append(next(n for n in hostnames(fields["NodeList"], env) if n != fields["BatchHost"]))
        assert kill_node(env, job, lost[1]), f"no processes of job {job} on {lost[1]}"
        info = wait_for(lambda: (i := backend.info(job)).state.finished and i, 120, "the job to end")
    finally:
        # The hosts come back (replaced ones would) for whatever runs next.
        for node in lost:
            subprocess.run(["slurmd", "-N", node, "-f", env["SLURM_CONF"]], env=env, check=False)
    completed_s = time.monotonic() - killed_at
    log = job_log(info)
    print(f"\nkill -> requeued {requeued_s:.1f} s, -> second loss -> ended {completed_s:.1f} s")
    print("\n".join(line for line in log.splitlines() if line.startswith(("hpkit", "srun"))))
    fields = job_fields(job, env)
    assert fields["JobState"] == "NODE_FAIL" and fields["Restarts"] == "1", (fields, log)
    events = job_events(tmp_path / "logs", job)
    runs = events_of(events, "run_started")
    assert [r["restart"] for r in runs] == [0, 1], events
    # The second run knows Slurm requeued it, and which node of the previous run is down.
    assert (runs[1]["requeued_by"], runs[1]["lost_nodes"]) == ("slurm", [lost[0]]), runs[1]
    # The lost node is DOWN: Slurm places the requeued job on the others without being told.
    assert lost[0] in hostnames(runs[0]["nodes"], env) and lost[0] not in hostnames(runs[1]["nodes"], env)
    # The second run had spent the budget: Slurm's requeue was off, so the second loss ended the job.
    assert runs[1]["budget_left"] == 0 and events_of(events, "requeue_off"), events
    # Slurm ended it: the supervisor neither ran a third time nor called a step the program's failure.
    assert not [e for e in events_of(events, "end") if e["outcome"] in ("budget_spent", "program_failed")], (
        log
    )

    # Resumed from the first run's checkpoint, and every step either run logged has the reference loss.
    saved_step = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
    assert saved_step >= INTERVAL and stopped_at - saved_step <= INTERVAL, (saved_step, stopped_at)
    assert min(steps_of_run(metrics, 2)) == saved_step + 1, sorted(steps_of_run(metrics, 2))
    got = losses(metrics)
    assert sorted(got) == list(range(1, SECOND_LOSS_STEP + 1)), sorted(got)
    for step, loss in got.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7), f"step {step}"


def wait_for_requeue(job: str, env: dict[str, str], metrics: Path, killed_at: float) -> tuple[float, int]:
    """After a node of `job` was killed at `killed_at` (time.monotonic()): wait until Slurm has requeued the job,
    within the collective timeout and the cluster's detection margin; the seconds that took and the last step
    the first run logged."""
    wait_for(lambda: CliBackend().info(job).state != JobState.RUNNING, 120, "the job to leave RUNNING")
    requeued_s = time.monotonic() - killed_at
    stopped_at = max(losses(metrics))  # before the requeued run can log a step
    fields = job_fields(job, env)
    assert fields["JobState"] in ("PENDING", "COMPLETING") and fields["Restarts"] == "1", fields
    assert requeued_s < COLLECTIVE_TIMEOUT_S + detection_margin_s(env), f"requeued {requeued_s:.0f} s after"
    return requeued_s, stopped_at


def requeue_after_node_loss(
    env: dict[str, str], reference_losses: dict[int, float], tmp_path: Path, lost: str
) -> float:
    """A node of a job without spares lost at the first checkpoint commit: Slurm requeues the job, which
    resumes to the reference losses. Returns the seconds from the kill to the resumed run's first step."""
    backend = CliBackend()
    tmp_path.mkdir(exist_ok=True)
    spec = training_spec("lost", tmp_path, STEPS, interval=INTERVAL)
    spec["resilience"].update(max_restarts=2, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    job = submit(spec, tmp_path, env)
    metrics = tmp_path / "lost.jsonl"

    wait_for_first_commit(tmp_path / "lost-ckpt", 240)
    fields = job_fields(job, env)
    first_nodes = hostnames(fields["NodeList"], env)
    batch_host = fields["BatchHost"]
    lost_node = batch_host if lost == "batch-host" else next(n for n in first_nodes if n != batch_host)
    starts_before = starts_in(metrics)
    victims = kill_node(env, job, lost_node)
    killed_at, killed_wall = time.monotonic(), time.time()
    assert victims, f"no processes of job {job} on {lost_node}"

    try:
        requeued_s, stopped_at = wait_for_requeue(job, env, metrics, killed_at)
        wait_for(lambda: "resumed from" in job_log(backend.info(job)), 300, "the resume", poll=0.5)
    finally:
        # The host comes back (a replaced one would) for whatever runs next.
        subprocess.run(["slurmd", "-N", lost_node, "-f", env["SLURM_CONF"]], env=env, check=False)
    info = wait_for(lambda: (i := backend.info(job)).state.finished and i, 300, "the resumed job to end")
    completed_s = time.monotonic() - killed_at

    log = job_log(info)
    print(f"\nkill -> requeued {requeued_s:.1f} s, -> COMPLETED {completed_s:.1f} s")
    print("\n".join(line for line in log.splitlines() if line.startswith(("hpkit", "srun"))))
    assert info.state == JobState.COMPLETED, log
    assert job_fields(job, env)["Restarts"] == "1"
    events = job_events(tmp_path / "logs", job)
    runs = [e["nodes"] for e in events_of(events, "run_started")]
    assert len(runs) == 2, events
    # The second run knows Slurm requeued it, and which node of the previous run is down.
    second = events_of(events, "run_started")[1]
    assert (second["requeued_by"], second["lost_nodes"]) == ("slurm", [lost_node]), second
    # The lost node is DOWN: Slurm places the requeued job on the others without being told.
    assert lost_node in hostnames(runs[0], env) and lost_node not in hostnames(runs[1], env)
    assert not [e for e in events_of(events, "end") if e["outcome"] == "program_failed"], events

    saved_step = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
    assert saved_step >= INTERVAL and stopped_at - saved_step <= INTERVAL, (saved_step, stopped_at)
    got = losses(metrics)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference_losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), f"step {step}"
    recovery_s = first_step_after_restart(metrics, starts_before)["time"] - killed_wall
    print(f"kill -> the resumed run's first step {recovery_s:.1f} s (requeue path)")
    return recovery_s


def test_a_lost_node_is_replaced_by_a_spare_inside_the_job(three_nodes, reference_losses, tmp_path):
    """resilience.spare_nodes: 1 on three nodes: the node of rank 0 (and of the rendezvous store) is lost at
    the first checkpoint commit, and the job goes on on the other step node and the spare: same job, no
    requeue, and the reference losses. (How much sooner than a requeue: bench/bench_recovery.py.)"""
    spare_after_node_loss(three_nodes, reference_losses, tmp_path)


def spare_after_node_loss(env: dict[str, str], reference_losses: dict[int, float], tmp_path: Path) -> float:
    """Rank 0's node of a job with a spare lost at the first checkpoint commit: the spare takes its place in
    the same job, which ends with the reference losses. Returns the seconds from the kill to the next step."""
    backend = CliBackend()
    tmp_path.mkdir(exist_ok=True)
    spec = training_spec("spare", tmp_path, STEPS, interval=INTERVAL)
    spec["resilience"].update(max_restarts=2, spare_nodes=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    job = submit(spec, tmp_path, env)
    metrics = tmp_path / "spare.jsonl"

    wait_for_first_commit(tmp_path / "spare-ckpt", 240)
    info = backend.info(job)
    placed = events_of(job_events(tmp_path / "logs", job), "run_started")
    assert placed, job_log(info)
    (rank0_node, other_node), (spare,) = placed[0]["step_nodes"], placed[0]["spares"]
    # The spare is the batch host: a step node's loss never takes the batch script with it.
    assert spare == job_fields(job, env)["BatchHost"]
    starts_before = starts_in(metrics)
    victims = kill_node(env, job, rank0_node)
    killed_wall = time.time()
    assert victims, f"no processes of job {job} on {rank0_node}"
    try:
        info = wait_for(lambda: (i := backend.info(job)).state.finished and i, 300, "the job to end")
    finally:
        subprocess.run(["slurmd", "-N", rank0_node, "-f", env["SLURM_CONF"]], env=env, check=False)
    log = job_log(info)
    print("\n".join(line for line in log.splitlines() if line.startswith(("hpkit", "srun"))))
    assert info.state == JobState.COMPLETED, log
    # Inside the same job: Slurm never requeued it, and its script ran once.
    events = job_events(tmp_path / "logs", job)
    assert job_fields(job, env)["Restarts"] == "0" and len(events_of(events, "run_started")) == 1, events
    swaps = events_of(events, "spare_swap")
    assert [(e["node"], e["spare"]) for e in swaps] == [(rank0_node, spare)], events
    restarts = events_of(events, "restart")
    assert [e["nodes"] for e in restarts] == [[spare, other_node]], events
    assert events_of(events, "probe")[0]["unanswering"] == [rank0_node], events
    assert not events_of(events, "requeue"), events
    # The step on the spare ran to the end: the run continued.
    assert events_of(events, "end")[-1]["outcome"] == "completed"

    # How fast, next to the requeue path: bench/bench_recovery.py (timings belong to the bench).
    recovery_s = first_step_after_restart(metrics, starts_before)["time"] - killed_wall
    print(f"kill -> the next step on the spare {recovery_s:.1f} s")

    got = losses(metrics)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference_losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), f"step {step}"
    return recovery_s


def test_a_program_that_fails_by_itself_is_not_requeued(three_nodes, tmp_path):
    env, backend = three_nodes, CliBackend()
    spec = training_spec("broken", tmp_path, 10, interval=5, launcher="srun")
    spec["command"] = [sys.executable, "-c", "raise SystemExit(3)"]
    spec["resilience"].update(max_restarts=2)
    job = submit(spec, tmp_path, env)
    info = wait_for(lambda: (i := backend.info(job)).state.finished and i, 120, "the broken job to end")
    log = job_log(info)
    assert info.state == JobState.FAILED, log
    assert re.search(r"task \d: Exited with exit code 3", log), log
    # srun's own status may be 143 rather than 3: --kill-on-bad-exit ends the other task with SIGTERM.
    events = job_events(tmp_path / "logs", job)
    assert events_of(events, "end")[-1]["outcome"] == "program_failed", events
    assert not events_of(events, "requeue"), events
    tasks = events_of(events, "step_ended")[-1]["tasks"]
    assert any(t["exit_code"] == 3 for t in tasks), events
    assert job_fields(job, env)["Restarts"] == "0"


# In-memory checkpoints (checkpoint.memory): the run is held after step MEMORY_STEP (a rank hangs before the next
# one), so the newest in-memory step is known; the persistent checkpoint of step INTERVAL is older.
MEMORY_STEP = 15
# Steps of these runs: a few past MEMORY_STEP are enough to compare the resumed run with the reference (the learning
# rate is constant, so a shorter run's steps are the longer one's), and each step copies the state to the partner
# node (about a second a step on a loaded machine, where steps 16-60 took 20-45 s).
MEMORY_STEPS = MEMORY_STEP + 5


def memory_spec(
    name: str, tmp_path: Path, node_memory: Path, held_rank: int = 1
) -> tuple[dict, dict[str, str]]:
    spec = training_spec(name, tmp_path, MEMORY_STEPS, interval=INTERVAL)
    spec["checkpoint"]["memory"] = {"every": 1}
    spec["resilience"].update(max_restarts=2, spare_nodes=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    # Rank `held_rank` sleeps before step MEMORY_STEP + 1 on the first attempt only: every rank has finished
    # MEMORY_STEP and its in-memory copy, and no later step starts until the node is lost. The other rank waits
    # in the step's first collective (held_rank 0, on the node that is lost: the survivor sees its peer go).
    extra = {
        "HPKIT_FAULT": f"hang:rank={held_rank},step={MEMORY_STEP + 1}",
        "HPKIT_MEMORY_ROOT": str(node_memory),
    }
    return spec, extra


def memory_step_complete(root: Path, step: int, nodes: list[str]) -> bool:
    """Every node of the step holds `step` whole (its `complete` mark, written after every copy is in place)."""
    return all(any(root.glob(f"hpkit-mem-*/*/{node}/step-{step:08d}/complete")) for node in nodes)


def lose_node_held_after_memory_step(
    env,
    tmp_path: Path,
    name: str,
    wipe_partner: bool,
    memory: bool = True,
    fault: str = "node",
    model: dict | None = None,
    warm: bool = False,
    node_memory: Path | None = None,
    keep_survivors: bool = False,
):
    """Run `name` with in-memory checkpoints until it is held after MEMORY_STEP and kill rank 0's node, having
    moved checkpoint.dir away (a restore from it would find nothing) or, with `wipe_partner`, taken the partner
    node's memory (both copies of rank 0's state gone); without `memory` the same drill with persistent
    checkpoints only (bench/bench_recovery.py runs both side by side, and with `fault` "rank" kills rank 0's
    process alone, SIGKILL, its node left up, and with `model` trains that model for two steps past MEMORY_STEP;
    `warm` turns resilience.warm_start on, and `keep_survivors` resilience.keep_survivors; `node_memory`: the nodes' memory root, default `tmp_path/shm` on the
    test's disk, bench_recovery's a tmpfs folder as on a real node). Returns the job's log, losses, last step before the kill, the two step nodes and the recovery's timeline
    (`recovery_timeline`)."""
    backend = CliBackend()
    tmp_path.mkdir(exist_ok=True)
    node_memory = tmp_path / "shm" if node_memory is None else node_memory
    # A survivor must be in a collective when its peer goes, not held in the fault's sleep.
    spec, extra = memory_spec(name, tmp_path, node_memory, held_rank=0 if keep_survivors else 1)
    patience = 1.0
    if model is not None:
        spec["model"] = model
        spec["train"]["steps"] = MEMORY_STEP + 2
        # A larger model's steps and copies take tens of seconds each on a loaded 2-vCPU host (at load 25, a 125M
        # step and its copy passed the hang watchdog's 60 s: the run restarted for a hang, not for the fault).
        spec["resilience"]["collective_timeout_s"] = 180
        spec["resilience"]["hang"] = {"min_s": 300}
        patience = 5.0
    if not memory:
        del spec["checkpoint"]["memory"]
    spec["resilience"]["warm_start"] = warm
    # As asked, not the default (on for warm CPU ranks): the warm side is the restart it is measured against.
    spec["resilience"]["keep_survivors"] = keep_survivors
    job = submit(spec, tmp_path, {**env, **extra})
    ckpt, metrics = tmp_path / f"{name}-ckpt", tmp_path / f"{name}.jsonl"
    placed = wait_for(
        lambda: events_of(job_events(tmp_path / "logs", job), "run_started"), 240, "the run to start"
    )
    (rank0_node, other_node), _ = placed[0]["step_nodes"], placed[0]["spares"]
    if keep_survivors:
        # torchrun's rendezvous orders the ranks: the node lost is the one whose rank is held (rank 0), as the
        # node's zygote names it.
        def forked_rank0() -> str | None:
            log = Path(backend.info(job).stdout or "/nonexistent")
            found = (
                re.search(r"warm start on (\S+): rank 0 \(attempt 0\) forked", log.read_text())
                if log.exists()
                else None
            )
            return found.group(1) if found else None

        rank0_node = wait_for(forked_rank0, 240, "rank 0's zygote line")
        other_node = next(n for n in placed[0]["step_nodes"] if n != rank0_node)
    held = (
        (lambda: memory_step_complete(node_memory, MEMORY_STEP, [rank0_node, other_node]))
        if memory
        else (lambda: MEMORY_STEP in losses(metrics))
    )
    wait_for(held, 300 * patience, f"step {MEMORY_STEP} in memory on both nodes", poll=0.1)
    assert (ckpt / "latest").exists() and not (ckpt / f"step-{MEMORY_STEP + 1:08d}").exists()
    stopped_at = max(losses(metrics))
    if memory and not wipe_partner:  # the restore must come from memory: checkpoint.dir holds nothing to read
        ckpt.rename(ckpt.with_name(ckpt.name + ".away"))
    elif wipe_partner:
        for folder in node_memory.glob(f"hpkit-mem-*/*/{other_node}"):
            shutil.rmtree(folder)
    victims = (
        kill_node(env, job, rank0_node)
        if fault == "node"
        else kill_rank(job, rank0_node, Path(backend.info(job).stdout or "/nonexistent"))
    )
    killed_wall = time.time()
    assert victims, f"no processes of job {job} on {rank0_node}"
    try:
        info = wait_for(
            lambda: (i := backend.info(job)).state.finished and i, 300 * patience, "the job to end"
        )
    finally:
        if fault == "node":
            subprocess.run(["slurmd", "-N", rank0_node, "-f", env["SLURM_CONF"]], env=env, check=False)
    log = job_log(info)
    print("\n".join(line for line in log.splitlines() if line.startswith(("hpkit", "srun"))))
    events = job_events(tmp_path / "logs", job)
    if fault == "rank" and info.state != JobState.COMPLETED:
        # Not recovered (the bench reports how it ended): a step failing on nodes that all answer is the
        # program's own failure to the supervisor.
        ended = events_of(events, "end")
        return (
            log,
            losses(metrics),
            stopped_at,
            (rank0_node, other_node),
            {
                "ended": (ended[-1]["time"] if ended else time.time()) - killed_wall,
                "outcome": ended[-1]["outcome"] if ended else str(info.state),
            },
        )
    assert info.state == JobState.COMPLETED, log
    swapped = [rank0_node] if fault == "node" else []
    assert [(e["node"]) for e in events_of(events, "spare_swap")] == swapped, events
    timeline = recovery_timeline(events, metrics, killed_wall)
    return log, losses(metrics), stopped_at, (rank0_node, other_node), timeline


# The parts of a recovery in order, each named by the mark that ends it (seconds after the fault): the fault
# seen by the supervisor (a task's exit), the step stopped, the nodes probed and the spare swapped in, the step
# started again, then the resumed run's start-up (hpkit.runtime.run.START_PHASES: its process created after
# srun and torchrun's agents, hpkit and torch imported, the process group joined, the model built, the in-memory
# tier set up, the state restored), its start record, its first step, and the first step past MEMORY_STEP
# (after the steps redone).
RECOVERY_MARKS = (
    "detected",
    "stopped",
    "swapped",
    "step_started",
    "process",
    "imported",
    "group",
    "trainer",
    "memory",
    "restored",
    "resumed",
    "first_step",
    "new_step",
)


def recovery_timeline(
    events: list[dict], metrics: Path, killed_wall: float, past: int = MEMORY_STEP
) -> dict[str, Any]:
    """Seconds from the kill to each of RECOVERY_MARKS, from the supervisor's events and the resumed run's start
    record, "new_step" being the first step past `past` (the last step the run had trained before the fault);
    `source` is what the run resumed from."""
    ended = events_of(events, "step_ended")[0]
    failing = events_of(events, "step_failing")
    marks = {
        "detected": (failing[0] if failing else ended)["time"],
        "stopped": ended["time"],
        # No swap where the nodes all answer (a rank killed): the restart's own event instead.
        "swapped": (events_of(events, "spare_swap") or events_of(events, "restart"))[0]["time"],
        "step_started": events_of(events, "step_started")[1]["time"],
    }
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    after = records[starts[-1] :]
    marks.update(after[0].get("phases") or {})
    marks["resumed"] = after[0]["time"]
    marks["first_step"] = next(r["time"] for r in after if "loss" in r)
    marks["new_step"] = next(r["time"] for r in after if r.get("step") == past + 1 and "loss" in r)
    timeline: dict[str, Any] = {name: at - killed_wall for name, at in marks.items()}
    timeline["source"] = after[0].get("resumed_from")
    timeline["stayed"] = after[0].get("stayed")
    return timeline


def test_a_lost_node_resumes_from_its_partners_memory_without_the_checkpoint_dir(
    three_nodes, reference_losses, tmp_path
):
    """checkpoint.memory: rank 0's node is lost after step 15 with checkpoint.dir moved away: the spare's rank
    takes its state from the partner node's memory, the run resumes at step 15 (the persistent checkpoint is
    step 10, and gone), redoes no step, and every loss equals the uninterrupted run's. With warm starts on, the
    restarted ranks are forked by the zygotes of the survivor and the spare."""
    log, got, stopped_at, (_, other), timeline = lose_node_held_after_memory_step(
        three_nodes, tmp_path, "memory", wipe_partner=False, warm=True
    )
    # resilience.warm_start: the restarted step's ranks and torchrun agents were forked by the zygotes of the
    # survivor and of the spare that took the lost node's place (the losses below are theirs), none started cold.
    spare = re.findall(r"spare (\S+) takes its place", log)
    assert len(spare) == 1, log
    # Which node gets rank 0 is torchrun's rendezvous's choice: each node has one agent and one rank, all forked.
    forked = re.findall(
        r"hpkit: warm start on (\S+): (rank \d+|hpkit.torchrun_agent) \(attempt 1\) forked", log
    )
    nodes = sorted([spare[0], other])
    assert sorted(n for n, what in forked if what == "hpkit.torchrun_agent") == nodes, log
    assert sorted(n for n, what in forked if what.startswith("rank")) == nodes, log
    assert sorted(what for _, what in forked if what.startswith("rank")) == ["rank 0", "rank 1"], log
    assert "warm start refused" not in log, log
    # The first step waited for the zygotes of its two nodes, and its agents and ranks forked too.
    assert "hpkit: warm starts: every zygote serves after" in log, log
    first = re.findall(r"hpkit: warm start on \S+: (rank \d+|hpkit.torchrun_agent) \(attempt 0\) forked", log)
    assert sorted(first) == ["hpkit.torchrun_agent"] * 2 + ["rank 0", "rank 1"], log
    # Every part of the recovery is timed (bench_recovery splits it by these), in the order the parts run (the
    # start record's time is rounded to the millisecond).
    at = [timeline[mark] for mark in RECOVERY_MARKS]
    assert all(b >= a - 0.01 for a, b in itertools.pairwise(at)), timeline
    assert timeline["source"] == f"memory:step-{MEMORY_STEP:08d}", timeline
    assert f"resumed from memory:step-{MEMORY_STEP:08d} at step {MEMORY_STEP}" in log, log
    assert re.search(
        rf"restored step {MEMORY_STEP} from memory: [1-9]\d* file\(s\) from partner nodes", log
    ), log
    assert stopped_at == MEMORY_STEP  # nothing trained since the copy: no step is redone
    assert sorted(got) == list(range(1, MEMORY_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7), f"step {step}"


def test_a_node_lost_with_its_partners_memory_falls_back_to_the_checkpoint_dir(
    three_nodes, reference_losses, tmp_path
):
    """Both copies of rank 0's state gone (its node lost, its partner's memory lost): the run says which ranks'
    states were lost, and resumes from the newest persistent checkpoint (step 10) to the reference losses."""
    log, got, _, _, _ = lose_node_held_after_memory_step(three_nodes, tmp_path, "fallback", wipe_partner=True)
    # Two nodes held every copy: with both gone, no rank's state is left (a larger world names the ranks
    # lost and their nodes: tests/unit/test_memory_layout.py).
    assert re.search(
        r"no in-memory checkpoint is left on the live nodes \([^)]*\): the states of every rank", log
    ), log
    assert re.search(rf"resumed from \S+{INTERVAL:08d} at step {INTERVAL}", log), log
    assert sorted(got) == list(range(1, MEMORY_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7), f"step {step}"


def test_a_survivor_stays_in_its_process_and_the_restarted_step_takes_it_over(
    three_nodes, reference_losses, tmp_path
):
    """resilience.keep_survivors: rank 0's node is lost after step 15, checkpoint.dir moved away. The other node's
    rank leaves its broken group and stays in its process; the restarted step's rank on that node is that same
    process (adopted, not forked), the spare's is forked. The run resumes from memory at step 15, its start
    record says one rank stayed, and every loss equals the uninterrupted run's."""
    log, got, stopped_at, (_, other), timeline = lose_node_held_after_memory_step(
        three_nodes, tmp_path, "stays", wipe_partner=False, warm=True, keep_survivors=True
    )
    stays = re.findall(
        r"hpkit train: rank \d+ on (\S+) stays in process (\d+) for the next step: its process group broke",
        log,
    )
    assert [node for node, _ in stays] == [other], log
    adopted = re.findall(r"hpkit: warm start on (\S+): rank \d+ \(attempt 1\) adopted process (\d+)", log)
    assert adopted == stays, log
    spare = re.findall(r"spare (\S+) takes its place", log)
    forked = re.findall(r"hpkit: warm start on (\S+): rank \d+ \(attempt 1\) forked", log)
    assert forked == spare, log
    records = [json.loads(line) for line in (tmp_path / "stays.jsonl").read_text().splitlines()]
    assert [r.get("stayed") for r in records if r.get("event") == "start"] == [0, 1], records
    assert timeline["source"] == f"memory:step-{MEMORY_STEP:08d}", timeline
    assert stopped_at == MEMORY_STEP
    assert sorted(got) == list(range(1, MEMORY_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-6, abs=1e-7), f"step {step}"
