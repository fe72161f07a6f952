"""The train script's restart decisions, run by bash with Slurm's commands standing in.

Each case sets what the real commands would report (SLURM_RESTART_COUNT, sinfo's node states, the
step's exit) and checks the line the script logs and the Slurm calls it makes. The real cluster runs
the same paths in tests/integration/test_node_loss.py; these cover the branches it cannot reach
cheaply (a spent budget, hpkit's own requeue after USR1, requeue_on_failure off).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

# Every stand-in appends its argv to $CALLS, so a case can assert what the script asked of Slurm.
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"$CALLS"
# USR1_AT_SETUP: Slurm's warning signal reaches the batch shell (the parent of the $(...) this runs in)
# while it is still setting up, before the step starts.
if [[ -n ${USR1_AT_SETUP:-} && "$1 $2" == "show hostnames" ]]; then
  kill -USR1 "$(ps -o ppid= -p "$PPID" | tr -d ' ')"
fi
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") echo 'NodeName=node1 NodeAddr=10.0.0.1' ;;
  "show config") echo 'SlurmdTimeout           = 10 sec' ;;
esac
"""
# sinfo -h -N -n LIST -o '%N %t': the states a case gives in $NODE_STATES ("node1 idle,node2 down*").
FAKE_SINFO = """#!/bin/bash
echo "sinfo $*" >>"$CALLS"
tr ',' '\\n' <<<"$NODE_STATES"
"""
# The step: exits with $STEP_EXIT; with STEP_SIGNALS_BATCH it first sends the batch shell USR1, as
# Slurm does before a time limit, and waits to be passed the signal on.
FAKE_SRUN = """#!/bin/bash
echo "srun" >>"$CALLS"
# The script's probe of every node after a failed step: $PROBE_EXIT says whether they answer.
[[ ${*: -1} == true ]] && exit "${PROBE_EXIT:-0}"
if [[ -n ${STEP_SIGNALS_BATCH:-} ]]; then
  trap 'exit 138' USR1
  kill -USR1 "$PPID"
  for _ in $(seq 100); do sleep 0.1; done
  exit 1
fi
exit "${STEP_EXIT:-0}"
"""
# The wait for Slurm to act on a lost node is real time; here it only records its length.
FAKE_SLEEP = """#!/bin/bash
[[ $1 == 0.1 ]] && exec /bin/sleep "$@"
echo "sleep $*" >>"$CALLS"
"""


@dataclass
class Run:
    returncode: int
    log: str
    calls: list[str]
    runs_file: str


def run_script(
    tmp_path: Path,
    resilience: dict,
    restarts: int | None = None,
    runs_file: str | None = None,
    node_states: str = "node1 idle,node2 idle",
    **env: str,
) -> Run:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (
        ("scontrol", FAKE_SCONTROL),
        ("sinfo", FAKE_SINFO),
        ("srun", FAKE_SRUN),
        ("sleep", FAKE_SLEEP),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    spec = parse_document(
        JobSpec, {"name": "r", "nodes": 2, "launcher": "srun", "command": ["train"], "resilience": resilience}
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec))
    (tmp_path / "logs").mkdir(exist_ok=True)
    record = tmp_path / "logs" / ".hpkit-42.runs"
    if runs_file is not None:
        record.write_text(runs_file)
    calls = tmp_path / "calls"
    calls.write_text("")
    full_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(calls),
        "NODE_STATES": node_states,
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_CPUS_ON_NODE": "2",
        **env,
    }
    if restarts is not None:
        full_env["SLURM_RESTART_COUNT"] = str(restarts)
    proc = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=60
    )
    return Run(
        proc.returncode,
        proc.stdout + proc.stderr,
        calls.read_text().splitlines(),
        record.read_text() if record.exists() else "",
    )


def hpkit_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("hpkit:")]


def test_a_first_run_records_its_nodes_and_leaves_slurms_requeue_on(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2})
    assert run.returncode == 0, run.log
    assert run.runs_file == "nodes node[1-2]\n"
    assert not [c for c in run.calls if c.startswith(("scontrol update", "scontrol requeue"))]
    assert "#SBATCH --requeue" in (tmp_path / "job.sbatch").read_text()


def test_a_restart_after_a_node_failure_names_the_node_that_is_down(tmp_path):
    run = run_script(
        tmp_path,
        {"max_restarts": 2},
        restarts=1,
        runs_file="nodes node[1-2]\n",
        node_states="node1 idle,node2 down*",
        SLURM_JOB_NODELIST="node[1,3]",
    )
    assert run.returncode == 0, run.log
    assert (
        "hpkit: restart 1: Slurm requeued the job after a node failure: node(s) node2 of the previous "
        "run (node[1-2]) are down"
    ) in hpkit_lines(run.log), run.log
    assert "sinfo -h -N -n node[1-2] -o %N %t" in run.calls
    assert run.runs_file == "nodes node[1,3]\n"


def test_a_restart_that_hpkit_asked_for_says_so(tmp_path):
    run = run_script(
        tmp_path, {"max_restarts": 2}, restarts=1, runs_file="nodes node[1-2]\nrequeued-by-hpkit 1\n"
    )
    assert "hpkit: restart 1: hpkit requeued the job itself after USR1 (time limit or preemption)" in (
        hpkit_lines(run.log)
    ), run.log


def test_a_restart_slurm_made_while_every_node_is_up_does_not_blame_a_node(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2}, restarts=1, runs_file="nodes node[1-2]\n")
    assert any(
        "Slurm requeued the job (node failure, preemption or administrator); the previous run's nodes "
        "(node[1-2]) are up now" in line
        for line in hpkit_lines(run.log)
    ), run.log


def test_the_last_run_the_budget_allows_turns_slurms_requeue_off(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2}, restarts=2, runs_file="nodes node[1-2]\n")
    assert run.returncode == 0, run.log
    assert "scontrol update JobId=42 Requeue=0" in run.calls
    assert "srun" in run.calls


def test_a_restart_past_the_budget_stops_with_one_line_and_runs_nothing(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2}, restarts=3, runs_file="nodes node[1-2]\n")
    assert run.returncode == 1
    assert hpkit_lines(run.log)[-1] == (
        "hpkit: the restart budget (resilience.max_restarts=2) is spent: not resuming"
    )
    assert "srun" not in run.calls


def test_a_program_failing_on_healthy_nodes_is_not_requeued(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2}, STEP_EXIT="3")
    assert run.returncode == 3
    assert hpkit_lines(run.log)[-1] == (
        "hpkit: the training program failed on healthy nodes (exit 3); not requeued"
    )
    assert not [c for c in run.calls if c.startswith(("scontrol requeue", "sleep"))]


@pytest.mark.parametrize(
    ("resilience", "restarts", "outcome"),
    [
        ({"max_restarts": 2}, 1, "Slurm requeues the job, which resumes from its last checkpoint"),
        (
            {"max_restarts": 2},
            2,
            "the restart budget (resilience.max_restarts=2) is used up, so Slurm ends the job as NODE_FAIL",
        ),
        (
            {"max_restarts": 2, "requeue_on_failure": False},
            0,
            "resilience.requeue_on_failure is off, so Slurm ends the job as NODE_FAIL",
        ),
    ],
)
def test_a_step_that_ends_on_a_lost_node_waits_for_slurm(tmp_path, resilience, restarts, outcome):
    run = run_script(
        tmp_path,
        resilience,
        restarts=restarts,
        runs_file="nodes node[1-2]\n",
        STEP_EXIT="1",
        node_states="node1 idle,node2 idle*",
    )
    lines = hpkit_lines(run.log)
    assert f"hpkit: the step ended (exit 1) after node(s) node2 stopped answering: {outcome}" in lines, (
        run.log
    )
    # SlurmdTimeout and a margin: slurmctld ends this script before then when it declares the node DOWN.
    assert "sleep 40" in run.calls
    assert not [c for c in run.calls if c.startswith("scontrol requeue")]


@pytest.mark.parametrize("requeue_on_failure", [True, False])
def test_usr1_requeues_through_hpkit_and_marks_the_requeue_as_its_own(tmp_path, requeue_on_failure):
    resilience = {"max_restarts": 2, "requeue_on_failure": requeue_on_failure}
    run = run_script(tmp_path, resilience, STEP_SIGNALS_BATCH="1")
    assert run.returncode == 0, run.log
    assert "hpkit: requeueing job 42 (restart 1 of 2); it resumes from its last checkpoint" in run.log
    assert run.runs_file == "nodes node[1-2]\nrequeued-by-hpkit 1\n"
    requeue = run.calls.index("scontrol requeue 42")
    # Without requeue_on_failure the job is not requeueable until hpkit makes it so for this requeue.
    turned_on = "scontrol update JobId=42 Requeue=1"
    if requeue_on_failure:
        assert turned_on not in run.calls
    else:
        assert run.calls.index(turned_on) < requeue


def test_a_usr1_during_set_up_is_passed_on_to_the_step_not_fatal(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2}, USR1_AT_SETUP="1")
    assert run.returncode == 0, run.log
    assert "hpkit: USR1 received: asking the ranks to checkpoint and stop" in run.log
    assert "scontrol requeue 42" in run.calls


def test_without_requeue_on_failure_a_node_failure_ends_the_job(tmp_path):
    run = run_script(
        tmp_path, {"max_restarts": 2, "requeue_on_failure": False}, restarts=1, runs_file="nodes x\n"
    )
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --no-requeue" in script
    # A later run turns off again what hpkit's USR1 requeue turned on.
    assert "scontrol update JobId=42 Requeue=0" in run.calls


def test_requeue_on_failure_needs_a_restart_budget():
    from hpkit.errors import SpecError

    with pytest.raises(SpecError, match="requeue_on_failure: true needs a restart budget"):
        parse_document(JobSpec, {"name": "r", "resilience": {"max_restarts": 0, "requeue_on_failure": True}})
    script = render(parse_document(JobSpec, {"name": "r", "resilience": {"max_restarts": 0}}))
    assert "#SBATCH --no-requeue" in script and "runs_file" not in script
