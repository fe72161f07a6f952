"""`hpkit why` and `hpkit status` on jobs the controller has forgotten, read from accounting (slurmdbd, `sacct --json`).

A private cluster with accounting (slurm/dev ACCOUNTING=1: its own slurmdbd, a database in the machine's MariaDB,
no job-completion log, as on HyperPod's clusters) and MinJobAge=10. Three jobs end three ways: one fails (exit 3),
one is requeued after its node is lost (slurmd, slurmstepds and tasks killed together) and completes on another
node, one is preempted (cancelled for a job in QOS high, PreemptType=preempt/qos). Each job's verdict and status
are taken the moment it ends, while slurmctld still knows it, and again once slurmctld has purged it (the test
waits for that event: `scontrol show job` no longer knows the id); they must be the same. Without accounting the
second reading has nothing to go on: the requeue count, the exit code and the preemption live in slurmdbd only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_node_loss import kill_node

from _clusters import slot
from hpkit import devcluster

pytestmark = [pytest.mark.cluster]

SECOND_RUN_ENDS = 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then srun true; else srun sleep 600; fi'
# slurm/dev/up.sh's CRED_EXPIRE (20 by default): a requeued job may start that long after its requeue. Steps start
# within a second here; 8 s leaves room for a loaded machine (a step whose credential expires is refused).
CRED_EXPIRE_S = 8
# slurmctld keeps an ended job MinJobAge, then purges it at its next purge pass (every max(10, MinJobAge) s while
# MinJobAge < 60): the reading taken at a job's end has this long at least. At 2 s, readings (hpkit why and status,
# seconds each at a load of 15 to 30 on 2 cores) missed the controller in 3 of 9 runs.
MIN_JOB_AGE_S = 10
MARIADB_SH = Path(__file__).resolve().parents[2] / "slurm" / "dev" / "mariadb.sh"
PURGE_WAIT_S = 240  # slurmctld purges ended jobs every max(10, MinJobAge) s here (MinJobAge < 60); room for a loaded machine


def _run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _sbatch(env: dict[str, str], work: Path, *args: str) -> str:
    # sbatch's default output (slurm-JOB.out in the working directory): once the controller has forgotten the job,
    # `hpkit why` finds it from the working directory that accounting keeps.
    done = _run(["sbatch", "--parsable", *args], env, work)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _controller(job: str, env: dict[str, str]) -> dict[str, str] | None:
    done = _run(["scontrol", "show", "job", "-o", job], env)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return dict(
        field.split("=", 1)
        for field in done.stdout.split()
        if "=" in field and field.split("=", 1)[0].isalpha()
    )


def _step_runs(job: str, env: dict[str, str]) -> bool:
    done = _run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], env)
    return f"{job}.0" in done.stdout.split()


def _reading(job: str, env: dict[str, str], work: Path) -> dict:
    """What hpkit says of the job: its verdict (kind, summary, state) and its status (state, exit code)."""
    # Both at once: taken while the controller still knows the job, the reading has MinJobAge and the next purge
    # pass to finish in, and each command takes seconds on a loaded host.
    with ThreadPoolExecutor(max_workers=2) as pool:
        asked = [
            pool.submit(_run, [sys.executable, "-m", "hpkit", command, job, "--json"], env, work)
            for command in ("why", "status")
        ]
        why, status = (a.result() for a in asked)
    assert why.returncode == 0 and "Traceback" not in why.stderr, why.stderr
    verdict = json.loads(why.stdout)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    got = json.loads(status.stdout)
    return {
        "kind": verdict["kind"],
        "summary": verdict["summary"],
        "state": verdict["state"],
        "status": got["state"],
        "exit_code": got.get("exit_code"),
        "unreadable": verdict["unreadable"],
        "sacct": [e["text"] for e in verdict["evidence"] if e["source"].startswith("sacct")],
    }


def _when_ended(job: str, env: dict[str, str], work: Path, deadline: float) -> dict:
    """The reading taken as soon as the controller shows the job ended, while it still knows it."""
    while time.monotonic() < deadline:
        fields = _controller(job, env)
        assert fields is not None, f"job {job} was forgotten before it was seen ended"
        if fields["JobState"] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
            reading = _reading(job, env, work)
            # A reading that took longer than MIN_JOB_AGE_S may have missed the controller.
            assert not any("no longer remembers" in u for u in reading["unreadable"]), reading
            return reading
        time.sleep(0.2)
    pytest.fail(f"job {job} did not end in time")


@pytest.mark.parametrize("slurm", ["22.05", pytest.param("24.11", marks=pytest.mark.slurm_24_11)])
def test_why_and_status_of_a_forgotten_job_read_accounting_and_agree_with_the_controller(
    tmp_path_factory, slurm
):
    notes = tmp_path_factory.mktemp("notes")
    base = {**os.environ, "HPKIT_STATE_DIR": str(notes)}
    env = devcluster.client_env(
        tmp_path_factory.mktemp("accounting-cluster"),
        *slot("accounting"),
        nodes=3,
        base=base,
        min_job_age=MIN_JOB_AGE_S,
        slurmd_timeout=10,
        bf_interval=1,
        slurm=slurm,
        accounting=True,
    )
    # Measured (22.05, loaded host): the requeued job started 22 s after its requeue, the credential lifetime; no
    # claim here depends on it, and a shorter one keeps the same sequence (NODE_FAIL, requeue, a second run on
    # another node) 12 s shorter.
    env["CRED_EXPIRE"] = str(CRED_EXPIRE_S)
    work = tmp_path_factory.mktemp("accounting-jobs")
    with devcluster.running(env):
        # The machine's MariaDB outlives this run: its temporary tables must not live in the run's TMPDIR, which
        # the next run removes (every accounting cluster after it then failed to start).
        tmpdir = _run([str(MARIADB_SH), "tmpdir"], env).stdout.strip()
        assert tmpdir and Path(tmpdir).is_dir() and not Path(tmpdir).is_relative_to(tempfile.gettempdir()), (
            tmpdir
        )
        jobs = {
            "failed": _sbatch(env, work, "-J", "failed", "-w", "node1", "--wrap", 'srun sh -c "exit 3"'),
            # Its first run waits to lose its node; the run after the requeue completes.
            "requeued": _sbatch(
                env, work, "-J", "requeued", "--requeue", "-x", "node3", "--wrap", SECOND_RUN_ENDS
            ),
            "preempted": _sbatch(
                env, work, "-J", "preempted", "-w", "node3", "--exclusive", "--wrap", "srun sleep 600"
            ),
        }
        deadline = time.monotonic() + 300
        before = {"failed": _when_ended(jobs["failed"], env, work, deadline)}

        # The node under the requeued job dies; its next run goes to the other of node1 and node2.
        # Once its step runs: a node lost before srun's launch fails the launch, and the job ends FAILED.
        while not _step_runs(jobs["requeued"], env):
            assert time.monotonic() < deadline, "the requeued job's step never ran"
            time.sleep(0.2)
        lost = (_controller(jobs["requeued"], env) or {})["NodeList"]
        assert kill_node(env, jobs["requeued"], lost)
        # Its reading is taken the moment it ends, beside the preemption's: taken after the preempted job's reading
        # (seconds on a loaded host), it found the controller had already forgotten the job (a CI run, 24.11).
        with ThreadPoolExecutor(max_workers=1) as watcher:
            requeued = watcher.submit(_when_ended, jobs["requeued"], env, work, deadline + 120)
            while (_controller(jobs["preempted"], env) or {}).get("JobState") != "RUNNING":
                assert time.monotonic() < deadline, "the job to preempt never ran"
                time.sleep(0.2)
            _sbatch(
                env,
                work,
                "-J",
                "preemptor",
                "--qos=high",
                "-w",
                "node3",
                "--exclusive",
                "--wrap",
                "srun true",
            )
            before["preempted"] = _when_ended(jobs["preempted"], env, work, deadline)
            before["requeued"] = requeued.result()
        subprocess.run(["slurmd", "-N", lost, "-f", env["SLURM_CONF"]], env=env, check=False)

        purge_by = time.monotonic() + PURGE_WAIT_S
        for job in jobs.values():
            while _controller(job, env) is not None:
                assert time.monotonic() < purge_by, f"slurmctld still knows job {job} after {PURGE_WAIT_S} s"
                time.sleep(1)
        after = {name: _reading(job, env, work) for name, job in jobs.items()}

    for name in jobs:
        print(f"\n{name}: before {before[name]['summary']!r}; after {after[name]['summary']!r}")
        assert any("no longer remembers" in u for u in after[name]["unreadable"]), after[name]
        # A preempted job's exit code is a race in the controller (0 when the job ends, then the batch script's
        # 143 once its SIGTERM exit arrives); accounting keeps the 0 and the batch step's signal 15.
        keys = ("kind", "summary", "state", "status") + (("exit_code",) if name != "preempted" else ())
        for key in keys:
            assert after[name][key] == before[name][key], (name, key, before[name], after[name])
    assert before["failed"]["kind"] == "program_error" and before["failed"]["state"] == "FAILED"
    assert before["requeued"]["summary"].startswith("completed after 1 restart(s)"), before["requeued"]
    # Accounting's runs, each on its node: the lost one, then the other.
    runs = after["requeued"]["sacct"]
    assert any(r.startswith(f"run 1 of 2: NODE_FAIL on {lost},") for r in runs), runs
    assert any(r.startswith("run 2 of 2: COMPLETED on node") and f"on {lost}," not in r for r in runs), runs
    assert before["preempted"]["kind"] == "preempted" and before["preempted"]["state"] == "PREEMPTED"
