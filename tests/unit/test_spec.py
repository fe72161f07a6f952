"""Job spec validation: impossible values are refused with one line naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.jobs.submission import snapshot_text
from hpkit.spec import JobSpec, load_run_config
from hpkit.validation import load_document, parse_document

BASE = {"name": "job", "nodes": 2, "tasks_per_node": 2}


def error_of(data: dict) -> str:
    with pytest.raises(SpecError) as info:
        parse_document(JobSpec, data, "job.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({**BASE, "nodez": 2}, "nodez", "did you mean 'nodes'"),
        ({**BASE, "nodes": 0}, "nodes", "greater than or equal to 1"),
        ({**BASE, "parallelism": {"tp": 3}}, "parallelism", "does not divide the world size 4"),
        (
            {**BASE, "parallelism": {"dp_shard": 1, "tp": 2}},
            "parallelism",
            "multiply to 2, not the world size 4",
        ),
        ({**BASE, "parallelism": {"tp": -1, "pp": -1}}, "parallelism", "only one of"),
        ({**BASE, "parallelism": {"tp": 0}}, "parallelism", "tp=0"),
        (
            {**BASE, "parallelism": {"tp": 2, "tensor_parallel_degree": 4}},
            "parallelism",
            "conflicts with tp=2",
        ),
        (
            {**BASE, "parallelism": {"pp": 2, "microbatches": 1}},
            "parallelism",
            "microbatches=1 must be >= pp=2",
        ),
        (
            {**BASE, "parallelism": {"pp": 2, "microbatches": 4, "stages_per_rank": 2}},
            "parallelism",
            "stages_per_rank=2 needs a schedule that runs several stages per rank: set pp_schedule: "
            "interleaved_1f1b, or stages_per_rank: 1",
        ),
        (
            {**BASE, "parallelism": {"pp": 2, "microbatches": 4, "pp_schedule": "zero_bubble"}},
            "parallelism",
            "runs exactly 2 stages per rank, in a V: set stages_per_rank: 2",
        ),
        (
            {**BASE, "parallelism": {"pp": 2, "microbatches": 5, "pp_schedule": "interleaved_1f1b"}},
            "parallelism",
            "torch runs them in 2 rounds and needs microbatches divisible by that: use a multiple of pp (4 or 6)",
        ),
        (
            {**BASE, "parallelism": {"pp": 1, "pp_schedule": "interleaved_1f1b", "stages_per_rank": 2}},
            "parallelism",
            "set pp > 1, or stages_per_rank: 1",
        ),
        (
            # pp inferred from the world size (4): the microbatches no longer fill the pipeline.
            {**BASE, "parallelism": {"pp": -1, "dp_shard": 1, "microbatches": 3}},
            "parallelism",
            "microbatches=3 must be >= pp=4",
        ),
        (
            {
                **BASE,
                "parallelism": {
                    "pp": 2,
                    "microbatches": 4,
                    "pp_schedule": "interleaved_1f1b",
                    "stages_per_rank": 3,
                },
                "model": {"n_layers": 4},
            },
            "parallelism",
            "pp=2 x stages_per_rank=3 = 6 stages, but model.n_layers=4: lower pp or stages_per_rank",
        ),
        (
            {
                **BASE,
                "parallelism": {
                    "pp": 2,
                    "microbatches": 4,
                    "pp_schedule": "zero_bubble",
                    "stages_per_rank": 2,
                },
                "train": {"compile": True},
            },
            "train.compile",
            "set compile: false, or pp_schedule: interleaved_1f1b",
        ),
        (
            {
                **BASE,
                "parallelism": {
                    "pp": 2,
                    "microbatches": 4,
                    "pp_schedule": "zero_bubble",
                    "stages_per_rank": 2,
                },
                "train": {"activation_checkpoint": "selective"},
            },
            "train.activation_checkpoint",
            "use activation_checkpoint: full or none, or pp_schedule: interleaved_1f1b",
        ),
        ({**BASE, "parallelism": {"tpp": 2}}, "parallelism.tpp", "did you mean 'tp'"),
        ({**BASE, "env": {"A B": "1"}}, "env", "not a valid environment variable name"),
        ({**BASE, "name": "a b"}, "name", "letters, digits"),
        ({**BASE, "name": "x$(id)"}, "name", "letters, digits"),
        ({**BASE, "time_limit": "1 hour"}, "time_limit", "not a Slurm time"),
        ({**BASE, "time_limit": "99999999999999999999"}, "time_limit", "at most 4294967293 minutes"),
        ({**BASE, "time_limit": "\u0663\u0660"}, "time_limit", "not a Slurm time"),
        ({**BASE, "mem": "\u0663\u0660G"}, "mem", "not a Slurm size"),
        ({**BASE, "nodes": 10**20}, "nodes", "less than or equal to 1000000"),
        ({**BASE, "tasks_per_node": 10**20}, "tasks_per_node", "less than or equal to 65533"),
        ({**BASE, "cpus_per_task": 65534}, "cpus_per_task", "less than or equal to 65533"),
        ({**BASE, "gpus_per_node": 10**20}, "gpus_per_node", "less than or equal to 65533"),
        (
            {**BASE, "model": {"name": "debug", "n_layers": 10**20}},
            "model.n_layers",
            "less than or equal to 10000",
        ),
        (
            {**BASE, "model": {"name": "8B", "vocab_size": 10**11}},
            "model.vocab_size",
            "less than or equal to 16777216",
        ),
        ({**BASE, "partition": "p5;rm"}, "partition", "partition name"),
        ({**BASE, "output_dir": "my logs"}, "output_dir", "without whitespace"),
        ({**BASE, "launcher": "mpirun"}, "launcher", "'torchrun', 'srun' or 'mpi'"),
        ({**BASE, "container": {"image": "i", "mounts": ["relative:/x"]}}, "container.mounts", "absolute"),
        (
            {**BASE, "container": {"image": "i", "mounts": ["/a"]}},
            "container.mounts",
            "/host/path:/container/path",
        ),
        ({**BASE, "container": {"image": "i", "mounts": ["/a:/b,/c:/d"]}}, "container.mounts", "','"),
        ({**BASE, "container": {"image": ""}}, "container.image", "must not be empty"),
        ({**BASE, "gpus_per_node": 8, "tasks_per_node": 4}, "tasks_per_node=4", "one rank per GPU"),
        ({**BASE, "command": "python 'unclosed"}, "command", "give a list of arguments"),
        ({**BASE, "command": []}, "command", "at least 1"),
        (
            {**BASE, "train": {"metrics_file": "../../etc/x.jsonl"}},
            "train.metrics_file",
            "not a file inside output_dir",
        ),
        (
            {**BASE, "train": {"metrics_file": "a/../.."}},
            "train.metrics_file",
            "not a file inside output_dir",
        ),
    ],
)
def test_bad_values_name_their_field(data, field, words):
    message = error_of(data)
    assert message.startswith(f"job.yaml: {field}"), message
    assert words in message
    assert "Traceback" not in message


def test_each_problem_is_one_line():
    message = error_of({**BASE, "nodes": 0, "qos": "a b", "bogus": 1})
    lines = message.splitlines()
    assert len(lines) == 3
    assert {line.split(":")[1].strip() for line in lines} == {"nodes", "qos", "bogus"}


def test_sagemaker_aliases_and_ddp():
    spec = parse_document(
        JobSpec,
        {
            "name": "j",
            "nodes": 2,
            "gpus_per_node": 8,
            "parallelism": {
                "tensor_parallel_degree": 4,
                "pipeline_parallel_degree": 2,
                "microbatches": 4,
                "ddp": True,
            },
        },
    )
    assert spec.run.parallelism.resolve(spec.job.world_size) == {
        "dp_replicate": 2,
        "dp_shard": 1,
        "ep": 1,
        "tp": 4,
        "pp": 2,
    }
    spec = parse_document(
        JobSpec,
        {"name": "j", "nodes": 1, "tasks_per_node": 4, "parallelism": {"partitions": 2, "microbatches": 2}},
    )
    assert spec.run.parallelism.resolve(4) == {"dp_replicate": 1, "dp_shard": 2, "ep": 1, "tp": 1, "pp": 2}


def test_defaults_infer_fsdp_over_all_ranks():
    spec = parse_document(JobSpec, {"name": "j", "nodes": 2, "tasks_per_node": 2})
    assert spec.job.world_size == 4
    assert spec.run.parallelism.resolve(spec.job.world_size) == {
        "dp_replicate": 1,
        "dp_shard": 4,
        "ep": 1,
        "tp": 1,
        "pp": 1,
    }


def test_metrics_paths_are_normalised():
    spec = parse_document(JobSpec, {**BASE, "train": {"metrics_file": "./runs//a/../m.jsonl"}})
    assert spec.run.train.metrics_file == "runs/m.jsonl"
    assert (
        parse_document(JobSpec, {**BASE, "train": {"metrics_file": "/fsx/m.jsonl"}}).run.train.metrics_file
        == "/fsx/m.jsonl"
    )


def test_scalars_become_strings():
    spec = parse_document(
        JobSpec,
        {"name": "j", "time_limit": 30, "env": {"N": 1, "B": True}, "command": "python -c 'print(1)'"},
    )
    assert spec.job.time_limit == "30"
    assert spec.job.env == {"N": "1", "B": "true"}
    assert spec.job.command == ["python", "-c", "print(1)"]


def test_yaml_errors_point_at_the_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: j\nnodes: [1\n")
    with pytest.raises(SpecError, match=r"job.yaml: line \d+ is not valid YAML"):
        load_document(JobSpec, path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="a job spec is a mapping"):
        load_document(JobSpec, path)
    with pytest.raises(SpecError, match="no such file"):
        load_document(JobSpec, tmp_path / "missing.yaml")


def test_cli_prints_one_line_and_exits_1(tmp_path, repo):
    path = tmp_path / "job.yaml"
    path.write_text("name: j\nnodes: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "render", str(path)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(repo / "python"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert (
        proc.stderr.strip()
        == f"hpkit render: error: {path}: nodes: Input should be greater than or equal to 1"
    )


def test_example_job_specs_are_valid(repo):
    specs = sorted((repo / "slurm" / "jobs").glob("*.yaml"))
    assert specs, "slurm/jobs holds the example specs users copy"
    for path in specs:
        load_document(JobSpec, path)


def test_a_job_spec_is_a_slurm_job_and_the_training_blocks():
    """Every job kind shares SlurmJob's fields and checks; only training jobs carry RunConfig's blocks."""
    from hpkit.runtime.config import RunConfig
    from hpkit.slurm.job import SlurmJob
    from hpkit.validation import document_fields

    assert set(document_fields(JobSpec)) == set(SlurmJob.model_fields) | set(RunConfig.model_fields)
    # Resources without a training block: what nccl-tests and the all-nodes check submit.
    job = parse_document(SlurmJob, {"name": "probe", "nodes": 2, "launcher": "srun", "command": ["hostname"]})
    assert job.world_size == 2
    with pytest.raises(SpecError) as refused:
        parse_document(SlurmJob, {"name": "probe", "parallelism": {"tp": 2}})
    assert "parallelism" in str(refused.value)
    # The same Slurm check refuses in both.
    for model in (SlurmJob, JobSpec):
        with pytest.raises(SpecError, match="time_limit"):
            parse_document(model, {"name": "x", "time_limit": "ten"})
    # A check that needs both halves: the parallel degrees must divide the job's world size.
    with pytest.raises(SpecError, match="parallelism"):
        parse_document(JobSpec, {"name": "x", "nodes": 2, "parallelism": {"tp": 3}})


def test_moe_and_expert_parallel_are_checked_at_validation():
    from hpkit.runtime.config import RunConfig
    from hpkit.validation import parse_document

    def run_config(model: dict, **par) -> RunConfig:
        return parse_document(RunConfig, {"name": "m", "model": model, "parallelism": par})

    assert run_config({"name": "debug-moe"}, ep=2).parallelism.ep == 2
    assert run_config({"name": "debug", "moe": {"experts": 4}}, ep=4).model.moe.experts == 4
    with pytest.raises(
        SpecError, match=r"parallelism\.ep=2 splits a mixture of experts, but model debug is dense"
    ):
        run_config({"name": "debug"}, ep=2)
    with pytest.raises(SpecError, match=r"parallelism\.ep=4 must divide model\.moe\.experts=6"):
        run_config({"name": "debug", "moe": {"experts": 6}}, ep=4)
    with pytest.raises(
        SpecError, match=r"selective with parallelism\.ep=2: .* use activation_checkpoint: full"
    ):
        parse_document(
            RunConfig,
            {
                "name": "m",
                "model": {"name": "debug-moe"},
                "parallelism": {"ep": 2},
                "train": {"activation_checkpoint": "selective"},
            },
        )
    with pytest.raises(SpecError, match="top_k=3 is more than experts=2: lower top_k"):
        run_config({"name": "debug", "moe": {"experts": 2, "top_k": 3}})
    with pytest.raises(SpecError, match="moe cannot be given with init_from"):
        run_config({"init_from": "/x", "moe": {"experts": 2}})


REPO = Path(__file__).resolve().parents[2]
SHIPPED_SPECS = sorted(
    p for folder in ("slurm/jobs", "slurm/recipes") for p in (REPO / folder).glob("*.yaml")
)


@pytest.mark.parametrize("path", SHIPPED_SPECS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_shipped_specs_snapshot_reads_back_as_the_same_spec(path, tmp_path) -> None:
    """What every rank of the job reads (`hpkit train --config SNAPSHOT`) is the spec that was submitted. A
    snapshot of a spec with model.init_from used to be refused by its own job: it wrote model.name's default."""
    spec = load_document(JobSpec, path)
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text(snapshot_text(spec))
    assert load_document(JobSpec, snapshot) == spec
    assert load_run_config(snapshot) == spec.run


def test_a_snapshot_with_keys_this_hpkit_does_not_know_says_the_versions_differ(tmp_path) -> None:
    """A job's ranks read the snapshot `hpkit submit` wrote. An image built with an older hpkit than the login
    node's meets a key it does not know, which no user wrote: the error says what to do about that, not only which
    key. A file a user wrote gets the plain line."""
    spec = load_document(JobSpec, REPO / "slurm/jobs/demo.yaml")
    newer = snapshot_text(spec).replace("\nresilience:\n", "\nresilience:\n  a_later_field: true\n", 1)
    assert newer.startswith("# written by hpkit submit") and "a_later_field" in newer
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text(newer)
    with pytest.raises(SpecError) as refused:
        load_run_config(snapshot)
    first, second = str(refused.value).splitlines()
    assert "resilience.a_later_field: unknown key" in first
    assert second == (
        f"{snapshot}: hpkit submit wrote this file with keys this hpkit does not know: the hpkit where the job runs "
        "(in its image or environment) is older than the one that submitted it; install the same hpkit in both"
    )
    written = tmp_path / "mine.yaml"
    written.write_text(newer.split("\n", 1)[1])  # the same keys, without the line hpkit submit writes first
    with pytest.raises(SpecError) as refused:
        load_run_config(written)
    assert len(str(refused.value).splitlines()) == 1
