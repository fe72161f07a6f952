"""Polling the real cluster: one Slurm call per poll for many jobs, backing off, riding out a controller restart."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _clusters import slot
from hpkit import devcluster
from hpkit.errors import SlurmError
from hpkit.slurm import CliBackend, JobState, wait_all

pytestmark = pytest.mark.cluster

WRAPPER = """#!/bin/sh
# Logs each call (time, program, arguments), then runs the real program.
echo "$(date +%s.%N) {name} $*" >> "$CALL_LOG"
exec {real} "$@"
"""


def counting_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH with squeue/scontrol/sacct wrappers that log every call; returns (env additions, log)."""
    bin_dir = tmp_path / "counting-bin"
    bin_dir.mkdir()
    for name in ("squeue", "scontrol", "sacct"):
        real = shutil.which(name)
        assert real, name
        (bin_dir / name).write_text(WRAPPER.format(name=name, real=real))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALL_LOG": str(log)}, log


def sbatch(env: dict[str, str], cwd: Path, seconds: float) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", "-o", "out-%j.txt", "--wrap", f"sleep {seconds}; echo done-$SLURM_JOB_ID"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def calls(log: Path) -> list[tuple[float, str]]:
    out = []
    for line in log.read_text().splitlines():
        stamp, name, *_ = line.split()
        out.append((float(stamp), name))
    return out


def test_waiting_for_many_jobs_costs_one_call_per_poll(slurm_cluster, tmp_path):
    env = dict(slurm_cluster)
    jobs = [sbatch(env, tmp_path, s) for s in (2, 4, 6, 22)]
    extra, log = counting_path(tmp_path)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "wait", *jobs, "--backend", "cli"],
        env={**env, **extra},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    for job in jobs:
        assert re.search(rf"job {job} \(wrap\): COMPLETED", proc.stderr), proc.stderr
    seen = calls(log)
    names = [n for _, n in seen]
    # Everything came from squeue: no per-job scontrol, no sacct (the jobs were still in the controller).
    assert set(names) == {"squeue"}, names
    # One call per poll for all four jobs, and fewer than one a second once the jobs age (1 s → 2 s).
    assert len(names) <= took + 2, (len(names), took)
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(seen)]
    print(
        f"polling: {len(jobs)} jobs, {len(names)} squeue calls in {took:.1f} s, gaps {[round(g, 1) for g in gaps]}"
    )
    # After 10 s without a state change (the last before the long job's end: the third job's, at ~6 s; any
    # job's change resets the interval), polls are 2 s apart.
    assert max(gaps) >= 1.8, gaps

    # Once jobs leave the controller, sacct answers for all of them at once (here: the job-completion
    # log, since there is no slurmdbd; plain sacct is tried once, then skipped).
    log.write_text("")
    backend = CliBackend({**env, **extra})
    for _ in range(2):
        gone = backend._from_sacct(jobs)
        assert {j: i.state for j, i in gone.items()} == dict.fromkeys(jobs, JobState.COMPLETED)
    assert [n for _, n in calls(log)] == ["sacct", "sacct", "sacct"]

    # `hpkit status` without a job id: the user's jobs as a table, from one squeue call.
    log.write_text("")
    table = subprocess.run(
        [sys.executable, "-m", "hpkit", "status"],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    assert [n for _, n in calls(log)] == ["squeue"]
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["JOBID", "NAME", "STATE", "NODES", "ELAPSED", "TIME", "LEFT", "REASON"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    for job in jobs:
        assert rows[job][1:4] == ["wrap", "COMPLETED", "1"], lines
        assert re.fullmatch(r"node[12]", rows[job][4]) and re.fullmatch(r"00:00:\d\d", rows[job][5]), lines


def _stop_slurmctld(env: dict[str, str]) -> None:
    pidfile = Path(env["HPKIT_DEV_CLUSTER_DIR"]) / "run" / "slurmctld.pid"
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGTERM)  # SIGTERM: it saves its state, so the job survives the restart
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail("slurmctld did not stop")


def _read_until(stream, pattern: str, lines: list[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return line
    pytest.fail(f"no line matching {pattern!r} in: {''.join(lines)}")


def test_wait_rides_out_a_controller_restart_and_gives_up_on_a_long_outage(tmp_path_factory):
    """A private cluster, since its controller is stopped: the shared one serves other tests."""
    port, first = slot("polling")
    state = tmp_path_factory.mktemp("restart-cluster")
    env = devcluster.client_env(state, port, first)
    # A client command asks a stopped controller for MessageTimeout seconds before it fails (measured: 19 s at
    # 20), and the waiter that gives up needs three failed polls: 5 s keeps the same sequence a minute shorter.
    env["MESSAGE_TIMEOUT"] = "5"
    with devcluster.running(env):
        work = tmp_path_factory.mktemp("restart-work")
        job = sbatch(env, work, 25)
        waiter = subprocess.Popen(
            [sys.executable, "-m", "hpkit", "wait", job, "--backend", "cli"],
            env=env,
            cwd=work,
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        # And one showing the status line, which asks Slurm the same way.
        follower = subprocess.Popen(
            [sys.executable, "-m", "hpkit", "wait", job, "--follow", "--backend", "cli"],
            env=env,
            cwd=work,
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        try:
            _read_until(waiter.stderr, rf"job {job} \(wrap\): RUNNING", lines)
            _read_until(follower.stdout, rf"job {job} \(wrap\): RUNNING", [])
            _stop_slurmctld(env)
            _read_until(waiter.stderr, r"Slurm did not answer", lines)
            # Meanwhile a waiter with a short outage limit gives up, in one line.
            quitter = subprocess.run(
                [sys.executable, "-m", "hpkit", "wait", job, "--backend", "cli", "--outage-timeout", "3"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert quitter.returncode == 1, quitter.stderr
            last = quitter.stderr.strip().splitlines()[-1]
            assert re.match(r"hpkit wait: error: Slurm has not answered for \d+ s \(\d+ tries\)", last), last
            assert "Traceback" not in quitter.stderr
            devcluster.up(env)  # starts slurmctld again (the rest is still running)
            _read_until(waiter.stderr, r"Slurm answers again after \d+ s", lines)
            _, rest = waiter.communicate(timeout=120)
            shown, said = follower.communicate(timeout=60)
        finally:
            for process in (waiter, follower):
                if process.poll() is None:
                    process.kill()
        text = "".join(lines) + rest
        assert waiter.returncode == 0, text
        assert text.count("Slurm did not answer") == 1, text
        assert follower.returncode == 0, said
        assert said.count("Slurm did not answer") == 1 and "Slurm answers again" in said, said
        assert re.match(rf"job {job} \(wrap\): COMPLETED", shown.splitlines()[-1]), shown
        assert (work / f"out-{job}.txt").read_text().strip() == f"done-{job}"


CALLER_WRAPPER = """#!/bin/sh
# Logs which process of the job asked the controller (step and task, or the batch shell), then asks.
echo "{name} step=${{SLURM_STEP_ID:-none}} procid=${{SLURM_PROCID:-none}} node=${{SLURMD_NODENAME:-?}} $*" >> "$CALL_LOG"
exec {real} "$@"
"""
RANK_START = (
    "import os; from hpkit.runtime.env import read_launch_env; e = read_launch_env(os.environ); "
    # one write per line: the ranks share the output file (opened O_APPEND)
    "os.write(1, f'RANKINFO {e.rank} {e.world_size} {e.master_addr} {e.source}\\n'.encode())"
)


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_only_the_batch_script_asks_the_controller_at_start_up(slurm_cluster, tmp_path, launcher):
    """Every rank of a 2-node job starts without calling scontrol, sinfo or squeue: the batch shell
    resolves the rendezvous address once and exports it."""
    bin_dir = tmp_path / "caller-bin"
    bin_dir.mkdir()
    for name in ("scontrol", "sinfo", "squeue"):
        real = shutil.which(name)
        assert real, name
        (bin_dir / name).write_text(CALLER_WRAPPER.format(name=name, real=real))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {**slurm_cluster, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALL_LOG": str(log)}
    spec = {
        "name": f"startup-{launcher}",
        "nodes": 2,
        "tasks_per_node": 2,
        "launcher": launcher,
        "sagemaker_env": {},  # SM_HOSTS comes from the supervisor's host list, not from scontrol
        "command": [sys.executable, "-c", RANK_START],
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "submit", "spec.yaml", "--wait", "--follow", "--timeout", "180"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Ranks share the output file: find the records wherever a line break landed.
    ranks = sorted(m.split() for m in re.findall(r"RANKINFO (\d+ \d+ \S+ [a-z]+)", proc.stdout))
    assert [r[0] for r in ranks] == ["0", "1", "2", "3"], proc.stdout
    # One world, one rendezvous address for all, from the launcher's variables (no lookup of their own).
    assert {(r[1], r[3]) for r in ranks} == {("4", "torchrun" if launcher == "torchrun" else "env")}, ranks
    assert len({r[2] for r in ranks}) == 1, ranks
    in_job = [line for line in log.read_text().splitlines() if "node=?" not in line]  # hpkit wait's own polls
    # `submit --wait --follow`'s own calls (outside the job): Slurm's version once, then squeue only, one a
    # poll, the log streamed in between.
    own = [line.split()[0] for line in log.read_text().splitlines() if "node=?" in line]
    assert own.count("sinfo") <= 1 and {n for n in own if n != "sinfo"} == {"squeue"}, own
    print(f"{launcher}: controller calls from inside the job: {in_job}")
    assert in_job, "the batch shell's calls should be logged too (is the wrapper on the job's PATH?)"
    assert all(line.startswith("scontrol step=none") for line in in_job), in_job
    # NodeAddr for the rendezvous only: the supervisor reads the host list itself (hpkit.slurm.hostlist), SM_HOSTS
    # included.
    asked = sorted(line.split(" ", 4)[4] for line in in_job)
    assert asked == ["show node -o node1"], in_job


def test_logs_follow_streams_the_file_between_rare_polls(slurm_cluster, tmp_path):
    env = dict(slurm_cluster)
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-o",
            "follow-%j.txt",
            "--wrap",
            "for i in 1 2 3 4 5 6; do echo line-$i; sleep 1; done",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    extra, log = counting_path(tmp_path)
    started = time.monotonic()
    follow = subprocess.run(
        [sys.executable, "-m", "hpkit", "logs", "-f", job, "--backend", "cli"],
        env={**env, **extra},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout.splitlines() == [f"line-{i}" for i in range(1, 7)], follow.stdout
    names = [n for _, n in calls(log)]
    # No scontrol: the output path comes from squeue's record (its %j pattern expanded by hpkit).
    assert set(names) == {"squeue"} and len(names) <= took + 2, (names, took)


@pytest.mark.slurm_24_11
def test_status_and_wait_follow_of_a_job_make_one_slurm_call_each_poll(slurm_cluster, tmp_path):
    """`hpkit status JOB` is one squeue call (the job's files are found from that record, not from scontrol);
    `hpkit wait JOB --follow` asks nothing but squeue, once per poll."""
    env = dict(slurm_cluster)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nsleep 6\necho done-$SLURM_JOB_ID\n")
    proc = subprocess.run(
        ["sbatch", "--parsable", "-o", "out-%j.txt", str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    extra, log = counting_path(tmp_path)
    for args in (["status", job], ["status", job, "--json"], ["status"]):
        log.write_text("")
        done = subprocess.run(
            [sys.executable, "-m", "hpkit", *args],
            env={**env, **extra},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert [n for _, n in calls(log)] == ["squeue"], (args, log.read_text())
    log.write_text("")
    started = time.monotonic()
    follow = subprocess.run(
        [sys.executable, "-m", "hpkit", "wait", job, "--follow", "--backend", "cli"],
        env={**env, **extra},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert follow.returncode == 0, follow.stderr
    assert re.match(rf"job {job} \(job.sh\): COMPLETED", follow.stdout.splitlines()[-1]), follow.stdout
    names = [n for _, n in calls(log)]
    assert set(names) == {"squeue"} and len(names) <= took + 2, (names, took)


# The RPCs a client's query sends to slurmctld, by sdiag's message type (sdiag's own REQUEST_STATS_INFO and the
# daemons' messages, node registrations and job completions, are other traffic).
QUERY_RPCS = (
    "REQUEST_JOB_INFO",
    "REQUEST_JOB_INFO_SINGLE",
    "REQUEST_JOB_USER_INFO",
    "REQUEST_FED_INFO",
    "REQUEST_PARTITION_INFO",
    "REQUEST_NODE_INFO",
    "REQUEST_BUILD_INFO",
)


def rpc_counts(env: dict[str, str]) -> dict[str, int]:
    """sdiag's "Remote Procedure Call statistics by message type": count by type, since slurmctld started."""
    out = subprocess.run(["sdiag"], env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    table = out.split("statistics by message type", 1)[1].split("statistics by user", 1)[0]
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+\(\s*\d+\)\s+count:(\d+)", table, re.M)
    }


def query_rpcs(before: dict[str, int], after: dict[str, int]) -> int:
    return sum(after.get(k, 0) - before.get(k, 0) for k in QUERY_RPCS)


class OneCallPerJob(CliBackend):
    """What a poller that asks about each job on its own does (one squeue per job per poll)."""

    def poll(self, job_ids):
        found = {}
        for job_id in job_ids:
            found.update(super().poll([job_id]))
        return found


def waited_rpcs(backend: CliBackend, env: dict[str, str], jobs: list[str], polls: int) -> int:
    """slurmctld's query RPCs while wait_all polls `polls` times: its clock is virtual (the intervals pass at
    once, backing off as they would), every poll is a real Slurm call."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    before = rpc_counts(env)
    # Polls at 0, 1, ..., polls - 1 s (the first 10 s poll each second); then the timeout ends the wait.
    with pytest.raises(SlurmError, match="still running after"):
        wait_all(backend, jobs, timeout_s=polls - 1.5, clock=lambda: now[0], sleep=sleep, notify=print)
    return query_rpcs(before, rpc_counts(env))


def submit_sleepers(env: dict[str, str], state: Path, cwd: Path, count: int, seconds: float) -> list[str]:
    """`count` jobs of `sleep seconds`, from one shell's loop of sbatch calls. Under 24.11 that shell runs in the
    Slurm root (each client call from the host enters it anew: a dozen processes, most of a call's cost here)."""
    loop = (
        f"for _ in $(seq {count}); do "
        f"sbatch --parsable -o out-%j.txt --wrap 'sleep {seconds}; echo done-$SLURM_JOB_ID' || exit 1; done"
    )
    shell = "bash"
    if (state / "bin" / ".in-root").exists():
        (state / "in-root-shell").mkdir(exist_ok=True)
        shell = str(state / "in-root-shell" / "bash")
        if not os.path.islink(shell):  # up.sh's wrapper, called by the name of the root's bash
            os.symlink(state / "bin" / ".in-root", shell)
    done = subprocess.run([shell, "-c", loop], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    jobs = [line.split(";")[0] for line in done.stdout.split()]
    assert len(jobs) == count and all(j.isdigit() for j in jobs), done.stdout
    return jobs


def _cancel_all(env: dict[str, str]) -> None:
    """End the jobs while slurmd still runs: stopping the cluster alone leaves running batch shells behind."""
    subprocess.run(
        ["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True, timeout=60
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=60).stdout
        if not out.strip():
            return
        time.sleep(0.5)


@pytest.mark.parametrize("version", devcluster.SLURM_VERSIONS)
def test_controller_rpcs_of_a_wait_are_the_same_for_one_job_and_fifty(tmp_path_factory, version):
    """sdiag's RPC count of `hpkit wait`'s polling over K intervals: 50 jobs cost what 1 job costs. The same
    measure of one call per job grows 50-fold (it shows the measure can fail). Cheap `sleep` jobs on the
    module's private cluster (its 100 job ids; the session cluster's are for the other tests).

    22.05: `squeue --json` (every job) is one REQUEST_JOB_INFO a poll, whatever the number. 24.11: `squeue --json
    --states=all --jobs=a,b,...` is one REQUEST_JOB_INFO for two jobs or more, and for a single job squeue asks
    for that job alone (REQUEST_FED_INFO + REQUEST_JOB_INFO_SINGLE: two small RPCs, not the whole queue)."""
    port, first = slot("polling")
    state = tmp_path_factory.mktemp("rpc-cluster")
    env = devcluster.client_env(state, port, first, slurm=version)
    polls = 8
    with devcluster.running(env):
        if version != "22.05":  # up.sh links the clients hpkit runs into the 24.11 root; sdiag the same way
            (state / "bin" / "sdiag").symlink_to(".in-root")
        work = tmp_path_factory.mktemp("rpc-work")
        jobs = submit_sleepers(env, state, work, 50, 600)  # 4 run, 46 wait: none changes in the window
        try:
            hpkit = CliBackend(env)
            one, two, fifty = (waited_rpcs(hpkit, env, jobs[:n], polls) for n in (1, 2, 50))
            # One poll is enough to show the growth (each of its squeue calls is one of these).
            per_job_one, per_job_fifty = (waited_rpcs(OneCallPerJob(env), env, jobs[:n], 1) for n in (1, 50))
        finally:
            _cancel_all(env)
        print(
            f"Slurm {version}: slurmctld query RPCs over {polls} polls: hpkit wait 1 job {one}, 2 jobs {two}, "
            f"50 jobs {fifty}; one call per job over 1 poll: 1 job {per_job_one}, 50 jobs {per_job_fifty}"
        )
        # One RPC a poll for many jobs, and a little other traffic; a single job costs one poll's call too.
        assert polls <= fifty <= polls + 2, fifty
        assert abs(fifty - two) <= 2, (two, fifty)
        single = 1 if version == "22.05" else 2
        assert abs(one - single * polls) <= 2, one
        assert fifty <= one + 2, (one, fifty)  # 50 jobs never cost more than 1
        assert per_job_fifty >= 40 * per_job_one, (per_job_one, per_job_fifty)
