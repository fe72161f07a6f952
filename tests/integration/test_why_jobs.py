"""`hpkit why` on jobs that really ended each way, on a private local cluster, all side by side.

The cluster (4 nodes) enforces memory (slurm/dev MEMORY_KILL=1: jobacct_gather/linux kills a step over its
job's --mem) and declares a silent node DOWN after 10 s. The lost node's job runs alone on node3-4; every other
job excludes them. Each fault is the real thing: a Python exception on rank 2 of a torch.distributed program
(through hpkit.run_script), kill -9 of a training rank once its heartbeat shows steps, a program over its
--mem, slurmd and a training job's processes on a node killed together (the surviving rank's "Connection ... by
peer" must not be the verdict), a rank stuck in Python (HPKIT_FAULT hang) with no restart left, a 1-minute time
limit on a plain sbatch job (not hpkit's), scancel, and the USR1 that Slurm sends before a preemption (as
test_resilience.py delivers it). For every verdict, each evidence line is read back from the file and line it
names (or the command it names) and must be there.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from test_node_loss import job_fields, kill_node
from test_resilience import TINY_MODEL, submit

from _clusters import slot
from hpkit import devcluster
from hpkit.runtime.watchdog.hang_board import clear_reports, reports_of

pytestmark = [pytest.mark.cluster, pytest.mark.dist]

OTHERS = "node[3-4]"  # the lost node's pair: no other job may run there
# How long after its peer's node was killed a survivor may say nothing before its stacks are taken (it says "by peer"
# within 0.4 s on a loaded machine; twice in CI it said nothing until the job was cancelled, 28-29 s later).
SURVIVOR_SILENT_S = 5.0
LIVE = ("PENDING", "RUNNING", "COMPLETING", "UNLISTED")  # not yet ended (a job scontrol does not list counts)

RAISE_ON_RANK_2 = """\
import time

import torch
import torch.distributed as dist


def load_batch(step, rank):
    if rank == 2 and step == 3:
        raise ValueError(f"corrupt sample in batch {step}")
    return torch.ones(4) * step


dist.init_process_group("gloo")
for step in range(1, 1000):
    x = load_batch(step, dist.get_rank())
    dist.all_reduce(x)
    time.sleep(0.05)
"""

OVER_MEMORY = """\
import time

chunks = []
for _ in range(100):
    chunks.append(b"\\x01" * (20 << 20))  # 20 MiB, every page written
    time.sleep(0.05)
print("still alive with", len(chunks) * 20, "MiB", flush=True)
time.sleep(60)
"""


def spec(name: str, work: Path, **fields) -> dict:
    base = {
        "name": name,
        "nodes": 1,
        "tasks_per_node": 1,
        "launcher": "srun",
        "output_dir": str(work / "logs"),
        "exclude": OTHERS,
        "resilience": {"max_restarts": 0},
    }
    return {**base, **fields}


def training(name: str, work: Path, **resilience) -> dict:
    return spec(
        name,
        work,
        nodes=2,
        launcher="torchrun",
        mem="2G",
        command=[sys.executable, "-m", "hpkit", "train"],
        parallelism={"dp_shard": 2},
        model=TINY_MODEL,
        train={"steps": 100000, "local_batch_size": 2, "mixed_precision": "fp32", "tensorboard": False},
        resilience={"max_restarts": 0, "collective_timeout_s": 60, **resilience},
    )


def beats(work: Path) -> list[dict]:
    """The training ranks' reports (hpkit.runtime.watchdog.hang_board: node-local, and every node of the local cluster
    shares this host's /dev/shm) that show three steps done."""
    return [r for r in reports_of(work / "logs" / "hangs").values() if r.get("step", 0) >= 3]


def state(job: str, env) -> dict[str, str]:
    return job_fields(job, env)


def step_started(job: str, env) -> bool:
    """The job's first step runs: its script has set its USR1 trap by then (the trap comes after the first line)."""
    steps = subprocess.run(
        ["squeue", "--steps", f"--jobs={job}", "-h", "-o", "%i"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    return f"{job}.0" in steps


def job_states(env) -> dict[str, str]:
    """Every job the controller holds -> its state, from one `scontrol show job` (a poll of them all)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o"], env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return dict(re.findall(r"^JobId=(\d+) .*?\bJobState=(\w+)", out, re.M))


def native_stacks(pid: int, out: Path) -> str:
    """A live process's threads, native and Python frames (gdb, where the machine has it), written to `out`;
    what was written, or why nothing was."""
    if shutil.which("gdb") is None:
        return f"no stacks of {pid}: gdb is not installed"
    commands = ["-ex", "thread apply all bt 40", "-ex", "thread apply all py-bt"]
    done = subprocess.run(
        ["gdb", "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /", *commands],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out.write_text(done.stdout + done.stderr)
    return f"stacks of {pid} in {out}"


def _restart(env, node: str) -> None:
    subprocess.run(["slurmd", "-N", node, "-f", env["SLURM_CONF"]], env=env, check=False)


def why(job: str, env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkit", "why", job, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """Every job submitted at once, each fault set off on its event; returns (env, jobs, verdicts, facts)."""
    started = time.monotonic()
    env = devcluster.client_env(
        tmp_path_factory.mktemp("why-cluster"),
        *slot("why"),
        nodes=4,
        cpus=16,
        slurmd_timeout=10,
        memory_kill=True,
    )
    saved = os.environ.get("SLURM_CONF")
    with devcluster.running(env):
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]  # CliBackend asks the cluster SLURM_CONF names
        try:
            yield _run_all(env, tmp_path_factory, started)
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


def _run_all(env, tmp_path_factory, started):
    work = tmp_path_factory.mktemp("why-jobs")
    (work / "raise_on_rank.py").write_text(RAISE_ON_RANK_2)
    (work / "over_memory.py").write_text(OVER_MEMORY)
    python = sys.executable
    jobs: dict[str, str] = {}
    # The slowest first: Slurm checks time limits about every 30 s, so the 1-minute job ends 60-90 s in.
    plain = [
        "--time=1",
        f"--exclude={OTHERS}",
        f"--output={work}/plain-%j.out",
        "--wrap",
        "echo started; sleep 300",
    ]
    jobs["time_limit"] = subprocess.run(
        ["sbatch", "--parsable", *plain],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    specs = {
        "exception": spec(
            "exception",
            work,
            nodes=2,
            tasks_per_node=2,
            mem="2G",
            command=[python, str(work / "raise_on_rank.py")],
        ),
        "sigkill": training("sigkill", work / "sigkill"),
        "hang": {
            **training("hang", work / "hang", hang={"min_s": 5, "start_s": 120}),
            "env": {"HPKIT_FAULT": "hang:rank=1,step=6"},
        },
        # hpkit train's own exit on rank 1: rank 0's group breaks and it stays in its process (keep_survivors left
        # out, on for warm CPU ranks), so its agent's block says exit 86 and carries no traceback.
        "exit": {**training("exit", work / "exit"), "env": {"HPKIT_FAULT": "exit:rank=1,step=6,code=3"}},
        "oom": spec("oom", work, mem="200M", command=[python, str(work / "over_memory.py")]),
        "node_loss": {**training("node_loss", work / "node_loss"), "exclude": None, "nodelist": OTHERS},
        "cancel": spec("cancel", work, command=["sleep", "600"]),
        "preempt": spec("preempt", work, command=["sleep", "600"], resilience={"max_restarts": 1}),
        "completed": spec("completed", work, command=[python, "-c", "print('all done')"]),
    }
    submitting: dict[str, Future] = {}
    # Four `hpkit submit` processes at a time: the faults below wait on the jobs, the jobs on these.
    with ThreadPoolExecutor(4) as pool:
        for name, body in specs.items():
            body = {k: v for k, v in body.items() if v is not None}
            workdir = Path(body["output_dir"]).parent
            workdir.mkdir(exist_ok=True)
            # A rerun of this suite has the same folders and job ids, and the ranks it killed left their
            # node-local reports: without this, the poll below could read a dead run's pid before the new ranks
            # write theirs.
            clear_reports(workdir / "logs" / "hangs")
            submitting[name] = pool.submit(submit, body, workdir, env)
        jobs |= {name: job.result() for name, job in submitting.items()}
    workdirs = {name: Path(body["output_dir"]).parent for name, body in specs.items()}
    print(f"\nsubmitted {len(jobs)} jobs in {time.monotonic() - started:.1f} s: {jobs}")

    events: dict[str, float] = {}
    pending = {"sigkill", "node_loss", "cancel", "preempt", "hold"}
    deadline = time.monotonic() + 240
    killed_beat: dict = {}
    survivor_pids: list[int] = []
    survivor_stacks: list[str] = []
    lost_node = ""
    lost_at = 0.0  # when it was killed (Unix seconds: the logs' and metrics' clock)
    while pending and time.monotonic() < deadline:
        if "sigkill" in pending and (b := [b for b in beats(workdirs["sigkill"]) if b["rank"] == 1]):
            os.kill(b[0]["pid"], 9)  # the rank itself, once its heartbeat shows steps
            killed_beat.update(b[0])
            pending.discard("sigkill")
            events["sigkill"] = time.monotonic() - started
        if "node_loss" in pending and (b := beats(workdirs["node_loss"])):
            batch_host = state(jobs["node_loss"], env)["BatchHost"]
            # The node that is not the batch host dies (its slurmd, its steps, its ranks) once its rank trains.
            if lost := [x["node"] for x in b if x["node"] != batch_host]:
                lost_node = lost[0]
                survivor_pids = [x["pid"] for x in b if x["node"] != lost_node]
                assert kill_node(env, jobs["node_loss"], lost_node)
                lost_at = time.time()
                pending.discard("node_loss")
                pending.add("survivor")
                events["node_loss"] = time.monotonic() - started
        if "survivor" in pending and time.time() - lost_at > SURVIVOR_SILENT_S:
            # A survivor silent this long after its peer's death (2 CI runs so far): its stacks while it still runs.
            log = workdirs["node_loss"] / "logs" / f"node_loss-{jobs['node_loss']}.out"
            if "by peer" not in (log.read_text() if log.exists() else ""):
                survivor_stacks = [
                    native_stacks(pid, work / f"survivor-{pid}.stacks") for pid in survivor_pids
                ]
            pending.discard("survivor")
        for name in ("cancel", "preempt"):
            if name in pending and step_started(jobs[name], env):
                if name == "cancel":
                    subprocess.run(["scancel", jobs[name]], env=env, check=True)
                else:  # what Slurm sends B:USR1@grace before a preemption or time-limit kill
                    subprocess.run(["scancel", "--batch", "--signal=USR1", jobs[name]], env=env, check=True)
                pending.discard(name)
                events[name] = time.monotonic() - started
        if "hold" in pending and "preempt" not in pending:
            fields = state(jobs["preempt"], env)
            if fields["JobState"] == "PENDING" and fields["Restarts"] == "1":
                # Requeued: keep it pending (it could start again once the credential expires, 20 s).
                subprocess.run(["scontrol", "hold", jobs["preempt"]], env=env, check=True)
                pending.discard("hold")
                events["hold"] = time.monotonic() - started
        time.sleep(0.2)
    assert not pending, f"events that never came: {pending}"

    # Each job is judged as soon as it has ended (the requeued one once held, above): the `hpkit why` processes
    # run while the slowest job (the time limit, 60-90 s in) still runs, instead of after it.
    judged: dict[str, Future] = {}
    lost_back = False  # the lost node's slurmd restarted
    with ThreadPoolExecutor(2) as pool:
        judged["preempt"] = pool.submit(why, jobs["preempt"], env, "--json")
        try:
            deadline = time.monotonic() + 240
            while len(judged) < len(jobs) and time.monotonic() < deadline:
                states = job_states(env)
                for name, job in jobs.items():
                    if name in judged or states.get(job, "UNLISTED") in LIVE:
                        continue
                    if name == "node_loss" and lost_node:
                        _restart(env, lost_node)
                        lost_back = True
                    judged[name] = pool.submit(why, job, env, "--json")
                time.sleep(0.5)
        finally:
            if lost_node and not lost_back:
                _restart(env, lost_node)
        assert len(judged) == len(jobs), f"jobs that never ended: {sorted(set(jobs) - set(judged))}"
        events["all ended"] = time.monotonic() - started
        verdicts = {}
        for name, verdict in judged.items():
            done = verdict.result()
            assert done.returncode == 0 and done.stderr == "", (name, done.stderr)
            verdicts[name] = json.loads(done.stdout)
    events["verdicts"] = time.monotonic() - started
    print("events (s since start):", {k: round(v, 1) for k, v in events.items()})
    return {
        "env": env,
        "jobs": jobs,
        "verdicts": verdicts,
        "work": work,
        "killed": killed_beat,
        "lost": lost_node,
        "lost_at": lost_at,
        "survivor_stacks": survivor_stacks,
        "workdirs": workdirs,
    }


def assert_evidence_is_real(verdict: dict, env) -> None:
    """Each evidence line is in its source: that line of that file, or a line of that command's output."""
    assert verdict["evidence"], verdict
    for e in verdict["evidence"]:
        if e["line"] is None:
            command = e["source"].split()
            assert command[0] in ("scontrol", "sacct"), e
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30).stdout
            assert e["text"] in [line.strip() for line in out.splitlines()], e
        else:
            lines = Path(e["source"]).read_text(encoding="utf-8", errors="replace").split("\n")
            assert lines[e["line"] - 1].rstrip("\r") == e["text"], e


def verdict_of(ended, name: str) -> dict:
    verdict = ended["verdicts"][name]
    print(f"\n{name} ({ended['jobs'][name]}): {verdict['summary']}")
    for e in verdict["evidence"]:
        print(f"  {e['source']}:{e['line']}: {e['text'][:160]}")
    assert_evidence_is_real(verdict, ended["env"])
    return verdict


def test_an_exception_on_rank_2_is_a_program_error_with_its_file_and_line(ended):
    v = verdict_of(ended, "exception")
    script = ended["work"] / "raise_on_rank.py"
    assert (v["kind"], v["rank"]) == ("program_error", 2), v
    assert v["summary"] == f"program error on rank 2: ValueError: corrupt sample in batch 3 ({script}:9)"
    # the peers' "Connection closed by peer" is not the cause
    assert not any("Connection" in e["text"] for e in v["evidence"])
    # the text form: the same first line, exit status 0
    text = why(ended["jobs"]["exception"], ended["env"])
    assert text.returncode == 0 and text.stdout.splitlines()[0] == v["summary"]


def test_a_sigkilled_rank_is_named_with_its_signal(ended):
    v = verdict_of(ended, "sigkill")
    killed = ended["killed"]
    assert (v["kind"], v["rank"], v["node"]) == ("signal", 1, killed["node"]), v
    assert v["summary"] == f"killed by signal 9 (SIGKILL) on rank 1 ({killed['node']})"
    # torchrun names the process it started: the rank itself, or when the rank was forked warm, its client, which the
    # zygote's line maps to the rank (warm starts are on by default for a job without GPUs).
    log = ended["workdirs"]["sigkill"] / "logs" / f"sigkill-{ended['jobs']['sigkill']}.out"
    started = re.findall(rf"forked as process {killed['pid']} for process (\d+)", log.read_text()) or [
        killed["pid"]
    ]
    assert any(f"Signal 9 (SIGKILL) received by PID {started[-1]}" in e["text"] for e in v["evidence"]), v
    # The node comes from the killed rank's own agent, whatever srun reported of the nodes' agents and in what order.
    assert f"hpkit-torchrun: rank 1 failed on {killed['node']} (exit code -9)" in [
        e["text"] for e in v["evidence"]
    ], v


def test_a_rank_s_own_exit_is_the_program_error_not_the_survivor_that_stayed_in_its_process(ended):
    v = verdict_of(ended, "exit")
    assert (v["kind"], v["rank"]) == ("program_error", 1), v
    assert v["summary"].startswith("program error on rank 1: exit code 3"), v
    assert not any("exit code 86" in e["text"] or "exitcode  : 86" in e["text"] for e in v["evidence"]), v
    # The case this is about: the survivor did stay (without it, rank 0 ends with a traceback of its own).
    log = ended["workdirs"]["exit"] / "logs" / f"exit-{ended['jobs']['exit']}.out"
    assert "hpkit train: rank 0 on " in log.read_text() and " stays in process " in log.read_text()


def test_a_program_over_its_memory_limit_is_out_of_memory(ended):
    v = verdict_of(ended, "oom")
    assert v["kind"] == "out_of_memory" and v["rank"] == 0 and v["node"] in ("node1", "node2"), v
    job = ended["jobs"]["oom"]
    # The rank's own step, or the zygote's where it was forked warm (that step holds its memory).
    assert re.search(rf"StepId={job}\.\d+ exceeded memory limit", v["summary"]), v["summary"]
    assert any(e["source"].endswith(f"slurmd-{v['node']}.log") for e in v["evidence"]), v["evidence"]


def test_a_lost_node_is_a_node_failure_naming_it(ended):
    v = verdict_of(ended, "node_loss")
    assert (v["kind"], v["node"], v["state"]) == ("node_failure", ended["lost"], "NODE_FAIL"), v
    assert any(e["source"].endswith("slurmctld.log") and "on failed node" in e["text"] for e in v["evidence"])
    # The surviving rank's error, where it reached the log, is not the verdict: it follows from the lost node. It
    # reached it in 14 of 15 runs; in one (a loaded CI run, 160 ms steps against 25) the survivor printed nothing
    # in the 29 s before slurmctld declared the node down and cancelled the job.
    log = ended["workdirs"]["node_loss"] / "logs" / f"node_loss-{ended['jobs']['node_loss']}.out"
    survivor_said = "by peer" in log.read_text()
    # Where it did not, the kill's time against the last step's (the metrics'), in the run's warnings summary.
    if not survivor_said:
        metrics = log.with_name(log.name.replace(".out", ".metrics.jsonl"))
        last = [line for line in metrics.read_text().splitlines() if '"loss"' in line][-1:]
        warnings.warn(
            f"node_loss: the survivor said nothing; {ended['lost']} killed at {ended['lost_at']:.2f}, last step {last}; "
            f"{'; '.join(ended['survivor_stacks']) or 'no stacks taken'}",
            stacklevel=1,
        )
    assert survivor_said or "DUE TO NODE FAILURE" in log.read_text(), log.read_text()[-3000:]
    assert not any("by peer" in e["text"] for e in v["evidence"])


def test_a_hang_names_the_culprit_and_its_stacks_not_the_exit_75(ended):
    v = verdict_of(ended, "hang")
    assert v["kind"] == "hang" and v["rank"] == 1, v
    stacks = Path(v["summary"].rsplit("; stacks in ", 1)[1])
    assert (stacks / "rank1.txt").exists() and (stacks / "verdict.json").exists()
    assert v["summary"].startswith(f"hang: rank 1 on {v['node']} held up step 6")
    assert any(e["source"] == str(stacks / "verdict.json") for e in v["evidence"])


def test_a_time_limit_on_a_plain_sbatch_job(ended):
    v = verdict_of(ended, "time_limit")
    assert v["kind"] == "time_limit" and v["state"] == "TIMEOUT", v
    assert any("DUE TO TIME LIMIT" in e["text"] for e in v["evidence"])
    assert any(e["source"].endswith("slurmctld.log") for e in v["evidence"])


def test_a_cancel_says_by_whom_and_when(ended):
    v = verdict_of(ended, "cancel")
    me = pwd.getpwuid(os.getuid()).pw_name
    assert v["kind"] == "cancelled", v
    assert v["summary"].startswith(f"cancelled by {me} (uid {os.getuid()}) at 20")


def test_a_requeue_after_usr1_is_preempted_and_requeued(ended):
    v = verdict_of(ended, "preempt")
    assert v["kind"] == "preempted" and v["state"] == "PENDING", v
    assert v["summary"].startswith("preempted and requeued (restart 1 of 1)")


def test_a_job_that_ended_well_is_completed(ended):
    v = verdict_of(ended, "completed")
    assert (v["kind"], v["summary"], v["state"]) == ("completed", "completed", "COMPLETED")


def test_what_could_not_be_read_is_listed(ended):
    unreadable = ended["verdicts"]["completed"]["unreadable"]
    assert any(u.startswith("sacct: ") for u in unreadable), unreadable  # no slurmdbd here
