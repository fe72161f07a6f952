"""Rendered jobs submitted to the real local Slurm cluster (slurm/dev): launchers, failures, cancel."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpkit.slurm import CliBackend, JobState, wait

pytestmark = pytest.mark.cluster


def hpkit(*args: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submit(spec: dict, workdir: Path, env: dict[str, str]) -> str:
    path = workdir / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = hpkit("submit", str(path), cwd=workdir, env=env)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1)


def unlabelled(log: str) -> str:
    """A job log without the rank labels (`3: `) that srun --label and hpkit.run_script put on each line."""
    return re.sub(r"(?m)^ *\d+: ", "", log)


def output_of(info, timeout: float = 10) -> str:
    # slurmd can flip the state a moment before the last bytes reach the file system.
    deadline = time.monotonic() + timeout
    while not Path(info.stdout).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return Path(info.stdout).read_text()


@pytest.mark.slurm_24_11(launcher="torchrun")
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_two_nodes_join_one_process_group(slurm_cluster, tmp_path, launcher):
    spec = {
        "name": f"allreduce-{launcher}",
        "nodes": 2,
        "tasks_per_node": 2,
        "launcher": launcher,
        "command": [sys.executable, "-m", "hpkit.examples.allreduce"],
    }
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=180)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    assert info.exit_code == 0
    # Ranks share the output file; find the records wherever a line break landed.
    records = [json.loads(m) for m in re.findall(r"allreduce (\{[^{}]*\})", log)]
    assert len(records) == 4, log
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    for r in records:
        assert r["sum"] == 6.0  # 0 + 1 + 2 + 3, summed by the real collective
        assert r["world_size"] == 4 and r["env_world_size"] == "4"
        assert r["env_rank"] == str(r["rank"])
    by_node: dict[str, list[dict]] = {}
    for r in records:
        by_node.setdefault(r["node"], []).append(r)
    assert sorted(by_node) == ["node1", "node2"], "ranks must spread over both nodes"
    for node_records in by_node.values():
        assert sorted(r["env_local_rank"] for r in node_records) == ["0", "1"]
        # Ranks of one node are contiguous: local rank = rank mod ranks per node.
        assert all(int(r["env_local_rank"]) == r["rank"] % 2 for r in node_records)
    addrs = {r["master_addr"] for r in records}
    assert len(addrs) == 1 and "" not in addrs and None not in addrs
    if launcher == "srun":
        # The script resolves the first node's NodeAddr, not its (unresolvable) name.
        assert addrs == {"127.0.0.1"}
        assert sorted(r["rank"] for r in by_node["node1"]) == [0, 1]


@pytest.mark.slurm_24_11
def test_failing_job_is_reported_failed_with_its_exit_code(slurm_cluster, tmp_path):
    spec = {
        "name": "fails",
        "launcher": "srun",
        "command": [sys.executable, "-c", "import sys; print('about to fail'); sys.exit(1)"],
    }
    job_id = submit(spec, tmp_path, slurm_cluster)
    proc = hpkit("wait", job_id, "--poll", "0.5", "--timeout", "120", cwd=tmp_path, env=slurm_cluster)
    assert proc.returncode == 1, proc.stderr
    assert "FAILED, exit code 1" in proc.stderr
    info = CliBackend().info(job_id)
    assert (info.state, info.exit_code) == (JobState.FAILED, 1)
    status = hpkit("status", job_id, "--json", cwd=tmp_path, env=slurm_cluster)
    assert json.loads(status.stdout)["state"] == "FAILED"
    logs = hpkit("logs", job_id, cwd=tmp_path, env=slurm_cluster)
    assert "about to fail" in logs.stdout


@pytest.mark.slurm_24_11
def test_cancel_ends_the_job_and_its_steps(slurm_cluster, tmp_path):
    pid_file = tmp_path / "step.pid"
    spec = {
        "name": "sleeper",
        "nodes": 2,
        "launcher": "srun",
        "command": ["bash", "-c", f"echo $$ >> {pid_file}; exec sleep 300"],
    }
    job_id = submit(spec, tmp_path, slurm_cluster)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if pid_file.exists() and len(pid_file.read_text().split()) == 2:
            break
        time.sleep(0.2)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)

    proc = hpkit("cancel", job_id, cwd=tmp_path, env=slurm_cluster)
    assert proc.returncode == 0, proc.stderr
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=60)
    assert info.state == JobState.CANCELLED
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "the job's step processes outlived the cancel"


@pytest.mark.slurm_24_11
def test_the_24_11_cluster_runs_from_its_root_and_mounts_nothing_on_the_host(slurm_cluster_24_11):
    env = slurm_cluster_24_11
    state = Path(env["HPKIT_DEV_CLUSTER_DIR"])
    sinfo = subprocess.run(["sinfo", "--version"], env=env, capture_output=True, text=True, check=True)
    assert sinfo.stdout.strip() == "slurm-wlm 24.11.5"
    assert shutil.which("sbatch", path=env["PATH"]) == str(state / "bin" / "sbatch")
    # `. <dir>/etc/env` gives a shell the same commands.
    sourced = subprocess.run(
        ["bash", "-c", f". {state}/etc/env && command -v squeue && echo $SLURM_CONF"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sourced.stdout.split() == [str(state / "bin" / "squeue"), env["SLURM_CONF"]]
    # The daemons' binds live in their own mount namespace, not in this one's mount table.
    root = (state / "bin" / ".in-root").read_text().split("\nroot=", 1)[1].split("\n", 1)[0]
    assert Path(root, "etc/hpkit-slurm-root").is_file()
    assert root not in Path("/proc/self/mountinfo").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it only waits for its parent to reap it.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


HOSTILE = [
    "$(touch {canary})",
    "`touch {canary}`",
    "'; touch {canary}; '",
    '"; touch {canary}; "',
    "a\ntouch {canary}",
]


def test_hostile_strings_reach_the_program_literally(slurm_cluster, tmp_path):
    canary = tmp_path / "canary"
    payloads = [p.format(canary=canary) for p in HOSTILE]
    spec = {
        "name": "hostile",
        "launcher": "srun",
        "env": {"HOSTILE": payloads[0] + payloads[2]},
        "command": [
            sys.executable,
            "-c",
            "import json, os, sys; print('ARGS ' + json.dumps([sys.argv[1:], os.environ['HOSTILE']]))",
            *payloads,
        ],
    }
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=120)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    line = next(line for line in unlabelled(log).splitlines() if line.startswith("ARGS "))
    assert json.loads(line[5:]) == [payloads, payloads[0] + payloads[2]]
    assert not canary.exists()


def test_pyslurm_backend_submits_through_sbatch(slurm_cluster, tmp_path):
    """pyslurm re-parses #SBATCH lines and drops --signal (23.x): the script must reach sbatch itself."""
    import types

    from hpkit.slurm import PyslurmBackend

    fake = types.ModuleType("pyslurm")
    fake.JobSubmitDescription = None  # calling it would fail the test
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=via-sbatch\n#SBATCH --signal=B:USR1@120\n"
        f"#SBATCH --output={tmp_path}/%j.out\ntrue\n"
    )
    job_id = PyslurmBackend(fake).submit(script)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=60)
    assert (info.name, info.state) == ("via-sbatch", JobState.COMPLETED)


def test_slurm_options_reach_the_controller_and_the_step(slurm_cluster, tmp_path):
    """sbatch reads the typed fields and sbatch_options as written; srun_options reach the step."""
    # A dependency that stays unfulfilled until released: slurmctld drops a fulfilled one from the job (a
    # `singleton` here showed Dependency=(null) when the scheduler had looked before scontrol did, in one CI run).
    first = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--job-name=options-first", "--wrap=true"],
        capture_output=True,
        text=True,
        env=slurm_cluster,
        cwd=tmp_path,
        timeout=30,
        check=True,
    ).stdout.strip()
    spec = {
        "name": "options",
        "launcher": "srun",
        "exclude": "node2",
        "mem": "100M",
        "dependency": f"afterok:{first}",
        "mail_type": ["BEGIN", "END"],
        "mail_user": "ops@example.com",
        "signal": "B:USR1@90",
        "sbatch_options": ["--comment=made;by`hpkit`", "--hold", "--nice=5"],
        "srun_options": ["--label"],
        "command": ["echo", "hello from the step"],
    }
    job_id = submit(spec, tmp_path, slurm_cluster)
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        capture_output=True,
        text=True,
        env=slurm_cluster,
        timeout=30,
    ).stdout
    for expected in (
        "JobState=PENDING Reason=JobHeldUser",
        "ExcNodeList=node2",
        "MinMemoryNode=100M",
        f"Dependency=afterok:{first}(unfulfilled)",
        "MailUser=ops@example.com MailType=BEGIN,END",
        "Comment=made;by`hpkit`",
        "Nice=5",
    ):
        assert expected in shown, (expected, shown)
    for held in (first, job_id):
        subprocess.run(["scontrol", "release", held], check=True, env=slurm_cluster, timeout=30)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=120)
    assert info.state == JobState.COMPLETED and info.nodes == "node1"
    assert "0: hello from the step" in output_of(info)  # srun --label prefixes the task number


def test_a_venvs_hpkit_run_by_its_path_gives_the_job_the_venvs_torchrun(slurm_cluster, tmp_path):
    """As a user hits it: `/path/to/venv/bin/hpkit submit` from a shell that has not activated the venv."""
    hpkit_bin = Path(sys.executable).parent / "hpkit"
    env = {**slurm_cluster, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    assert shutil.which("torchrun", path=env["PATH"]) is None, "the test needs a PATH without torchrun"
    spec = {
        "name": "venv-path",
        "nodes": 2,
        "launcher": "torchrun",
        "command": ["python", "-m", "hpkit.examples.allreduce"],
    }
    path = tmp_path / "venv-path.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run(
        [str(hpkit_bin), "submit", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=180)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    assert len(re.findall(r"allreduce \{", log)) == 2, log


def test_a_program_missing_from_the_jobs_path_is_refused_before_sbatch(slurm_cluster, tmp_path):
    spec = {"name": "no-such", "launcher": "srun", "command": ["hpkit-no-such-program", "--x"]}
    path = tmp_path / "no-such.yaml"
    path.write_text(yaml.safe_dump(spec))
    before = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_cluster, capture_output=True, text=True)
    proc = hpkit("submit", str(path), cwd=tmp_path, env=slurm_cluster)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "hpkit-no-such-program is not on the job's PATH" in lines[0]
    assert "submitted job" not in proc.stdout
    after = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_cluster, capture_output=True, text=True)
    assert after.stdout == before.stdout


def test_the_python_job_api_submits_waits_and_reads_the_log(slurm_cluster, tmp_path, monkeypatch):
    """What docs/jobs.md's "From Python" shows, in this process: prepare, submit, wait_for, exit_status."""
    from hpkit.jobs.submission import prepare, submit
    from hpkit.jobs.watch import exit_status, wait_for

    monkeypatch.setenv("PATH", os.environ["PATH"])  # submit gives the job this environment's PATH
    spec = {
        "name": "from-python",
        "nodes": 2,
        "launcher": "srun",
        "workdir": str(tmp_path),
        "command": [sys.executable, "-c", "import os; print('api rank', os.environ['RANK'])"],
    }
    path = tmp_path / "from-python.yaml"
    path.write_text(yaml.safe_dump(spec))
    backend = CliBackend(slurm_cluster)
    job = submit(prepare(path), backend)
    infos = wait_for(backend, [job.job_id], poll_s=0.5, timeout_s=120)
    assert exit_status(infos) == 0 and infos[job.job_id].state == JobState.COMPLETED
    log = output_of(infos[job.job_id])
    assert Path(infos[job.job_id].stdout) == job.submission.log_file(job.job_id)
    assert sorted(line for line in unlabelled(log).splitlines() if line.startswith("api rank")) == [
        "api rank 0",
        "api rank 1",
    ]
    # A failing job's status is its exit code, as `hpkit wait` returns it. One node: with two, srun's
    # kill-on-bad-exit may end the other rank first and the job's code is then 143 (SIGTERM).
    spec.update(name="from-python-fails", nodes=1, command=[sys.executable, "-c", "raise SystemExit(3)"])
    path.write_text(yaml.safe_dump(spec))
    failed = submit(prepare(path), backend)
    assert exit_status(wait_for(backend, [failed.job_id], poll_s=0.5, timeout_s=120)) == 3
