"""The train script's spare-node decisions (resilience.spare_nodes), run by bash with Slurm's commands
standing in: which nodes each step runs on, which node a spare replaces, and what happens when the spares
run out. The real cluster runs the node-loss path in tests/integration/test_node_loss.py; these cover the
branches it cannot reach cheaply (a hang culprit's node, two lost nodes and one spare, a program error).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"$CALLS"
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\nnode3\\n' ;;
  "show node") echo "NodeName=$3 NodeAddr=addr-$3" ;;
esac
"""
# A probe (`srun ... --nodelist=NODE true`) fails for the nodes in $DEAD_NODES. A training step records
# its node list and rendezvous host, then plays the next entry of $STEP_PLAN (comma-separated, one per
# step): ok, fail, or hang:NODE (the watchdog's verdict naming NODE, and the ranks' exit 75).
FAKE_SRUN = """#!/bin/bash
nodelist=""
for arg in "$@"; do
  [[ $arg == --nodelist=* ]] && nodelist=${arg#--nodelist=}
done
if [[ ${*: -1} == true ]]; then
  [[ ",$DEAD_NODES," == *",$nodelist,"* ]] && exit 1
  exit 0
fi
step=$(wc -l <"$STEPS_FILE")
echo "step on $nodelist rendezvous $MASTER_ADDR attempt $HPKIT_STEP_ATTEMPT" >>"$STEPS_FILE"
IFS=, read -ra plan <<<"$STEP_PLAN"
case "${plan[$step]:-ok}" in
  ok) exit 0 ;;
  fail) exit 1 ;;
  hang:*)
    dir="logs/hangs/42-0-$HPKIT_STEP_ATTEMPT-0-step5"
    mkdir -p "$dir"
    echo "${plan[$step]#hang:}" >"$dir/culprit_nodes"
    echo '{}' >"$dir/verdict.json"
    exit 75 ;;
esac
"""
FAKE_QUIET = """#!/bin/bash
echo "$(basename "$0") $*" >>"$CALLS"
"""


@dataclass
class Run:
    returncode: int
    log: str
    calls: list[str]
    steps: list[str]


def run_script(tmp_path: Path, resilience: dict, plan: str, dead: str = "") -> Run:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("scontrol", FAKE_SCONTROL),
        ("srun", FAKE_SRUN),
        ("squeue", FAKE_QUIET),
        ("scancel", FAKE_QUIET),
        ("sinfo", FAKE_QUIET),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    spec = parse_document(
        JobSpec,
        {"name": "r", "nodes": 2, "launcher": "srun", "command": ["train"], "resilience": resilience},
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec))
    (tmp_path / "logs").mkdir()
    calls, steps = tmp_path / "calls", tmp_path / "steps"
    calls.write_text("")
    steps.write_text("")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(calls),
        "STEPS_FILE": str(steps),
        "STEP_PLAN": plan,
        "DEAD_NODES": dead,
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURMD_NODENAME": "node1",  # the batch host
        "SLURM_CPUS_ON_NODE": "2",
    }
    proc = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    return Run(
        proc.returncode,
        proc.stdout + proc.stderr,
        calls.read_text().splitlines(),
        steps.read_text().splitlines(),
    )


def test_steps_run_on_the_nodes_other_than_the_batch_host_which_is_the_spare(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2, "spare_nodes": 1}, plan="ok")
    assert run.returncode == 0, run.log
    assert run.steps == ["step on node2,node3 rendezvous addr-node2 attempt 0"]
    assert "hpkit: steps run on node2 node3; spare node(s): node1" in run.log
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script


def test_a_hang_culprits_node_is_replaced_by_the_spare_and_the_step_restarts_in_the_job(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2, "spare_nodes": 1}, plan="hang:node3,ok")
    assert run.returncode == 0, run.log
    assert run.steps == [
        "step on node2,node3 rendezvous addr-node2 attempt 0",
        "step on node2,node1 rendezvous addr-node2 attempt 1",
    ]
    assert "hpkit: node node3 is out of the job's steps; spare node1 takes its place" in run.log
    assert not [c for c in run.calls if c.startswith("scontrol requeue")]


def test_losing_rank_zeros_node_moves_the_rendezvous_to_the_spare(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2, "spare_nodes": 1}, plan="fail,ok", dead="node2")
    assert run.returncode == 0, run.log
    assert run.steps[1] == "step on node1,node3 rendezvous addr-node1 attempt 1"
    assert "node(s) not answering: node2" in run.log


def test_a_lost_node_with_no_spare_left_requeues_the_job(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2, "spare_nodes": 1}, plan="fail", dead="node2,node3")
    assert len(run.steps) == 1, run.log
    assert "hpkit: no spare node left for node3" in run.log
    assert "scontrol requeue 42" in run.calls, run.calls


def test_a_program_error_on_answering_nodes_uses_no_spare_and_is_not_requeued(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 2, "spare_nodes": 1}, plan="fail")
    assert run.returncode == 1, run.log
    assert len(run.steps) == 1
    assert "hpkit: the training program failed on healthy nodes (exit 1); not requeued" in run.log
    assert "takes its place" not in run.log and "scontrol requeue 42" not in run.calls


def test_spares_come_out_of_the_restart_budget(tmp_path):
    run = run_script(tmp_path, {"max_restarts": 1, "spare_nodes": 2}, plan="hang:node2,hang:node3,ok")
    assert len(run.steps) == 2, run.log
    assert "is spent: ending the job" in run.log
    assert run.returncode == 75


def test_replace_bad_nodes_renders_hyperpods_documented_call():
    spec = {"name": "r", "resilience": {"max_restarts": 1, "spare_nodes": 1, "replace_bad_nodes": True}}
    script = render(parse_document(JobSpec, spec))
    assert 'scontrol update node="$node" state=fail reason="Action:Replace"' in script
    assert "Action:Replace" not in render(parse_document(JobSpec, {**spec, "resilience": {"spare_nodes": 1}}))


def test_spare_nodes_need_a_restart_budget():
    with pytest.raises(SpecError, match=r"spare_nodes: 1 needs a restart budget.*max_restarts > 0"):
        parse_document(JobSpec, {"name": "r", "resilience": {"max_restarts": 0, "spare_nodes": 1}})
