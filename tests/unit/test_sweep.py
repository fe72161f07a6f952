"""Sweeps (`hpkit submit --sweep`, `--sweep-file`): override parsing, grid expansion, every task's spec validated by
the job spec's own validators, bad input as one line before anything is written, and the job array's names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpkit.errors import SpecError
from hpkit.job_events import job_key
from hpkit.jobs.files import spec_of_script, sweep_of_script
from hpkit.jobs.submission import prepare
from hpkit.jobs.sweep import (
    SWEEPABLE,
    Sweep,
    describe,
    expand,
    grid,
    parse_axis,
    read_manifest,
    read_sweep_file,
)
from hpkit.jobs.sweep_status import TaskRow, format_rows
from hpkit.runtime.run_identity import RunIdentity, sweep_overrides
from hpkit.slurm import as_task, expand_output_pattern, record_names
from hpkit.spec import load_run_config
from hpkit.supervise.plan import Run

PYTHON = str(Path(__file__).resolve().parents[2] / "python")


def base_spec(tmp_path: Path) -> dict:
    return {
        "name": "sw",
        "nodes": 1,
        "tasks_per_node": 1,
        "output_dir": str(tmp_path / "logs"),
        "command": [sys.executable, "-m", "hpkit", "train"],
        "train": {"steps": 4, "metrics_file": "m.jsonl"},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }


def test_an_axis_is_a_key_and_its_comma_separated_values():
    assert parse_axis("train.lr=1e-4,3e-4") == ("train.lr", [1e-4, 3e-4])
    assert parse_axis("train.seed=1, 2") == ("train.seed", [1, 2])
    assert parse_axis("model.name=debug,tiny") == ("model.name", ["debug", "tiny"])
    # Commas inside a list or mapping value do not split it.
    assert parse_axis("train.data={kind: tokens, path: /t},{kind: synthetic}") == (
        "train.data",
        [{"kind": "tokens", "path": "/t"}, {"kind": "synthetic"}],
    )
    assert parse_axis("train.grad_clip=null,1.0")[1] == [None, 1.0]


def test_flags_make_a_grid_first_flag_slowest():
    tasks = grid([parse_axis("train.lr=1e-4,3e-4"), parse_axis("train.seed=1,2")])
    assert tasks == [
        {"train.lr": 1e-4, "train.seed": 1},
        {"train.lr": 1e-4, "train.seed": 2},
        {"train.lr": 3e-4, "train.seed": 1},
        {"train.lr": 3e-4, "train.seed": 2},
    ]
    assert describe(tasks[1]) == "train.lr=0.0001 train.seed=2"


def test_a_sweep_file_is_a_list_of_tasks_or_a_grid(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- {train.lr: 1.0e-4}\n- {train.lr: 3.0e-4, train.seed: 7}\n")
    assert read_sweep_file(str(listed)) == [{"train.lr": 1e-4}, {"train.lr": 3e-4, "train.seed": 7}]
    gridded = tmp_path / "grid.json"
    gridded.write_text(json.dumps({"train.lr": [0.1, 0.2], "train.seed": [1, 2, 3]}))
    assert len(read_sweep_file(str(gridded))) == 6


def test_each_task_gets_its_spec_with_its_overrides_and_its_own_files(tmp_path):
    sweep = Sweep([{"train.lr": 0.1}, {"train.lr": 0.2, "model.dim": 64}])
    tasks = expand(base_spec(tmp_path), sweep, "job.yaml")
    assert [t.spec.run.train.lr for t in tasks] == [0.1, 0.2]
    assert tasks[1].spec.run.model.dim == 64 and tasks[0].spec.run.model.dim != 64
    assert [t.spec.run.train.metrics_file for t in tasks] == ["m.task0.jsonl", "m.task1.jsonl"]
    assert [t.spec.run.checkpoint.dir for t in tasks] == [str(tmp_path / "ckpt" / f"task{i}") for i in (0, 1)]
    # %j is each task's own id already (JOB_TASK): it is left as written.
    with_j = {**base_spec(tmp_path), "checkpoint": {"dir": "ckpt/%j"}}
    assert expand(with_j, sweep, "job.yaml")[0].spec.run.checkpoint.dir == "ckpt/%j"


LRS_400 = "train.lr=" + ",".join(f"{i}e-5" for i in range(1, 401))


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--sweep", "train.lrr=1,2"],
            "sweep task 0 (train.lrr=1): train.lrr: unknown key; did you mean 'lr'?",
        ),
        (
            ["--sweep", "train.lr=abc,1e-4"],
            "sweep task 0 (train.lr=abc): train.lr: Input should be a valid number",
        ),
        (["--sweep", "train.lr=-1"], "sweep task 0 (train.lr=-1): train.lr: Input should be greater than 0"),
        (["--sweep", "train.lr="], "--sweep train.lr: no values"),
        (["--sweep", "train.lr=1,,2"], "--sweep train.lr: an empty value"),
        (["--sweep", "train.lr"], "--sweep train.lr: write KEY=VALUE[,VALUE...]"),
        (["--sweep", "nodes=1,2"], "sweep task 0 (nodes=1): nodes: cannot be swept"),
        (["--sweep", "resilience.max_restarts=1,2"], "resilience.max_restarts: cannot be swept"),
        (["--sweep", "train.lr=1", "--sweep", "train.lr=2"], "--sweep train.lr: given twice"),
        (
            ["--sweep", "train.lr=1e-4,2e-4,0.0001"],
            "sweep task 2 (train.lr=0.0001): the same overrides as task 0",
        ),
        (["--sweep-file", "twice.yaml"], "sweep task 1 (train.seed=1.0): the same overrides as task 0"),
        # The same fields in another order are the same run.
        (["--sweep-file", "reordered.yaml"], "the same overrides as task 0"),
        (["--sweep", "train.steps.x=1"], "train.steps.x: train.steps is a value, not a block with fields"),
        (["--sweep", "train.lr=1", "--max-parallel", "0"], "--max-parallel 0: must be 1 or more"),
        (["--max-parallel", "2"], "--max-parallel: applies to a sweep only"),
        (["--sweep-file", "empty.yaml"], "empty.yaml: the sweep has no tasks"),
        (["--sweep-file", "scalar.yaml"], "grid's values are a list"),
        (["--sweep-file", "nodes.yaml"], "sweep task 1 (nodes=2): nodes: cannot be swept"),
        # Past MAX_TASKS at once, before a task is made: a 400 x 400 grid ran for minutes making 160,000.
        (
            ["--sweep", f"train.seed={','.join(map(str, range(400)))}", "--sweep", LRS_400],
            "the grid has 160,000 tasks, more than a sweep's 10,000",
        ),
        (["--sweep-file", "many.yaml"], "many.yaml has 10,001 tasks, more than a sweep's 10,000"),
        (["--sweep-file", "big-grid.yaml"], "the grid has 160,000 tasks"),
        # YAML reads dates and !!set sets, which JSON cannot show: the task's description ended in a TypeError.
        (
            ["--sweep-file", "date.yaml"],
            'sweep task 0 (train.lr="2024-01-01"): train.lr: Input should be a valid number',
        ),
        (
            ["--sweep-file", "set.yaml"],
            "sweep task 0 (train.lr=\"{'a'}\"): train.lr: Input should be a valid number",
        ),
    ],
)
def test_bad_sweeps_are_one_line_naming_the_field_before_anything_is_written(tmp_path, args, line):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(base_spec(tmp_path)))
    (tmp_path / "empty.yaml").write_text("[]\n")
    (tmp_path / "scalar.yaml").write_text("train.lr: 0.1\n")
    (tmp_path / "nodes.yaml").write_text("- {train.lr: 0.1}\n- {nodes: 2}\n")
    (tmp_path / "twice.yaml").write_text("- {train.seed: 1}\n- {train.seed: 1.0}\n")
    (tmp_path / "reordered.yaml").write_text(
        "- {train.seed: 1, train.lr: 0.1}\n- {train.lr: 0.1, train.seed: 1}\n"
    )
    (tmp_path / "date.yaml").write_text("- {train.lr: 2024-01-01}\n")
    (tmp_path / "set.yaml").write_text("- {train.lr: !!set {a}}\n")
    (tmp_path / "many.yaml").write_text("".join(f"- {{train.seed: {i}}}\n" for i in range(10_001)))
    (tmp_path / "big-grid.yaml").write_text(
        f"train.seed: {list(range(400))}\ntrain.lr: {list(range(1, 401))}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "submit", "job.yaml", "--dry-run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": PYTHON},
    )
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith("hpkit submit: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert line in proc.stderr, proc.stderr
    assert not (tmp_path / "logs").exists()  # no snapshot, no script


def test_only_the_training_blocks_can_be_swept():
    assert set(SWEEPABLE) == {"checkpoint", "collectives", "eval", "model", "parallelism", "train"}


def test_prepare_writes_one_array_script_and_a_spec_per_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(base_spec(tmp_path)))
    sweep = Sweep(grid([parse_axis("train.lr=0.1,0.2"), parse_axis("train.seed=1,2")]), max_parallel=2)
    submission = prepare("job.yaml", sweep)
    script = submission.script.read_text()
    assert "#SBATCH --array=0-3%2\n" in script
    assert f"#SBATCH --output={tmp_path}/logs/%x-%A_%a.out\n" in script
    assert submission.task_ids("77") == ["77_0", "77_1", "77_2", "77_3"]
    # What `hpkit status|why JOB_TASK` read back from the script: the task's spec, with its overrides.
    task2 = spec_of_script(submission.script, "2")
    assert task2 is not None and task2.name.endswith(".task2.yaml")
    cfg = load_run_config(task2)
    assert (cfg.train.lr, cfg.train.seed, cfg.train.metrics_file) == (0.2, 1, "m.task2.jsonl")
    assert spec_of_script(submission.script) is None  # the whole array has no one spec
    manifest = read_manifest(str(sweep_of_script(submission.script)))
    assert manifest is not None and [t.overrides for t in manifest] == sweep.tasks
    # The script itself gives task 2 its spec and its overrides.
    lines = script.splitlines()
    first = next(i for i, text in enumerate(lines) if text.startswith("export HPKIT_SPEC="))
    last = next(i for i, text in enumerate(lines) if text.startswith("export HPKIT_SWEEP="))
    shown = subprocess.run(
        [
            "bash",
            "-euc",
            "\n".join([*lines[first : last + 1], 'echo "$HPKIT_SPEC"; echo "$HPKIT_SWEEP_OVERRIDES"']),
        ],
        env={"SLURM_ARRAY_TASK_ID": "2", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    spec_path, overrides = shown.stdout.splitlines()
    assert Path(spec_path) == task2
    assert sweep_overrides({"HPKIT_SWEEP_OVERRIDES": overrides}) == {"train.lr": 0.2, "train.seed": 1}


def test_an_array_task_is_named_job_task_everywhere():
    env = {"SLURM_JOB_ID": "103", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "3"}
    assert job_key(env) == "100_3" and job_key({"SLURM_JOB_ID": "9"}) == "9"
    assert RunIdentity.from_env(env).job_id == "100_3"
    assert RunIdentity.from_env(env).expand("ckpt/%j") == "ckpt/100_3"
    run = Run.from_env(env)
    assert (run.job_id, run.name) == ("103", "100_3")  # files and Slurm commands name 100_3


def test_squeue_records_answer_to_job_task():
    assert record_names({"job_id": 103, "array_job_id": 100, "array_task_id": 3}) == ["103", "100_3"]
    # 23.02+ wraps numbers; the array's record of tasks not started yet answers for each of them.
    pending = {
        "job_id": 100,
        "array_job_id": {"set": True, "number": 100},
        "array_task_id": {"set": False, "infinite": False, "number": 0},
        "array_task_string": "2-3,5%2",
    }
    assert record_names(pending) == ["100", "100_2", "100_3", "100_5"]
    assert record_names({"job_id": 7, "array_job_id": 0, "array_task_id": 4294967294}) == ["7"]
    record = {"job_id": 103, "name": "sw", "array_job_id": 100, "array_task_id": 3}
    assert expand_output_pattern("/l/%x-%A_%a.out", record) == "/l/sw-100_3.out"
    # 22.05 (seen on the local cluster): the record of tasks not started has array_task_id null; asked as 100_5,
    # it is task 5's, log included (scontrol would give the log as sw-100_4294967294.out).
    waiting = {
        "job_id": 100,
        "name": "sw",
        "array_job_id": 100,
        "array_task_id": None,
        "array_task_string": "5%1",
    }
    assert record_names(waiting) == ["100", "100_5"]
    assert expand_output_pattern("/l/%x-%A_%a.out", as_task(waiting, "100_5")) == "/l/sw-100_5.out"
    assert as_task(record, "100_5") is record and as_task(waiting, "100") is waiting


def test_the_array_table_shows_every_task():
    rows = [
        TaskRow("5_0", {"train.lr": 0.1}, "COMPLETED", 4, 4, 2.5),
        TaskRow("5_1", {"train.lr": 0.2}, "FAILED", None, 4, None),
    ]
    assert format_rows(rows).splitlines() == [
        "TASK  OVERRIDES     STATE      STEP  LOSS",
        "5_0   train.lr=0.1  COMPLETED  4/4   2.5000",
        "5_1   train.lr=0.2  FAILED     -     -",
    ]


def test_a_sweep_with_no_overrides_in_a_task_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"sweep task 1 \(\): no overrides"):
        expand(base_spec(tmp_path), Sweep([{"train.lr": 0.1}, {}]), "job.yaml")
