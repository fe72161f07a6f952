"""JobSpec holds a SlurmJob (`job`) and a RunConfig (`run`) and inherits from neither, while its YAML stays flat:
every key of a spec is declared once (in SlurmJob, in RunConfig, or, for the keys both parts have, in JobIdentity,
which both parts are), reaches its part, and a problem with it is named as the user wrote it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hpkit.errors import SpecError
from hpkit.job_identity import JobIdentity
from hpkit.runtime.config import RunConfig
from hpkit.slurm.job import SlurmJob
from hpkit.spec import JobSpec
from hpkit.validation import document_fields, parse_document

KEYS = sorted(document_fields(JobSpec))
SHARED = sorted(set(SlurmJob.model_fields) & set(RunConfig.model_fields))


def _declarers(field: str) -> list[str]:
    """The classes of JobSpec and of its parts (their MROs) that declare `field` in their own class body."""
    classes = dict.fromkeys([*JobSpec.__mro__, *SlurmJob.__mro__, *RunConfig.__mro__])
    return [cls.__qualname__ for cls in classes if field in vars(cls).get("__annotations__", {})]


def test_a_job_spec_holds_its_parts_and_inherits_neither() -> None:
    assert not issubclass(JobSpec, (SlurmJob, RunConfig, JobIdentity))
    assert {name: f.annotation for name, f in JobSpec.model_fields.items()} == {
        "run": RunConfig,
        "job": SlurmJob,
    }


def test_the_parts_share_only_the_identity_fields() -> None:
    # Guards the next tests from passing vacuously: these three are what both parts have.
    assert SHARED == sorted(JobIdentity.model_fields) == ["instance_type", "name", "output_dir"]
    assert len(KEYS) == len(SlurmJob.model_fields) + len(RunConfig.model_fields) - len(SHARED)


@pytest.mark.parametrize("field", KEYS)
def test_every_key_of_a_spec_is_declared_once(field: str) -> None:
    assert len(_declarers(field)) == 1, f"{field} is declared by {_declarers(field)}: declare it once"


@pytest.mark.parametrize("field", SHARED)
def test_a_shared_field_reads_the_same_in_both_parts(field: str) -> None:
    infos = {model.__name__: repr(model.model_fields[field]) for model in (SlurmJob, RunConfig)}
    assert len(set(infos.values())) == 1, infos


def test_the_identity_is_written_once_and_reaches_both_parts() -> None:
    spec = parse_document(
        JobSpec, {"name": "x", "output_dir": "out", "instance_type": "p5.48xlarge", "nodes": 2}, "job.yaml"
    )
    for part in (spec.job, spec.run):
        assert (part.name, part.output_dir, part.instance_type) == ("x", "out", "p5.48xlarge")
    assert spec.job.nodes == 2 and spec.run.train.steps == RunConfig().train.steps


def test_parts_built_apart_must_name_the_same_job() -> None:
    job, run = SlurmJob(name="x", nodes=2), RunConfig(name="x")
    assert JobSpec(job=job, run=run).job is job
    with pytest.raises(ValidationError, match="name: the job part has 'x', the run part 'train'"):
        JobSpec(job=job, run=RunConfig())


def test_the_document_is_the_flat_spec_and_reads_back_as_the_same_spec() -> None:
    data = {"name": "x", "nodes": 2, "tasks_per_node": 2, "train": {"steps": 3}, "env": {"A": "1"}}
    spec = parse_document(JobSpec, data, "job.yaml")
    document = spec.document()
    # The order the snapshot has always had: identity, training blocks, then Slurm's keys.
    assert list(document) == [*RunConfig.model_fields, *(k for k in SlurmJob.model_fields if k not in SHARED)]
    assert sorted(document) == KEYS
    assert parse_document(JobSpec, document, "snapshot.yaml") == spec


def test_only_a_bare_training_file_may_leave_out_the_name() -> None:
    assert parse_document(RunConfig, {}, "train.yaml").name == "train"
    for model in (SlurmJob, JobSpec):
        with pytest.raises(SpecError) as info:
            parse_document(model, {"nodes": 1}, "job.yaml")
        assert str(info.value) == "job.yaml: name: missing: this field is required"


@pytest.mark.parametrize("model", [JobSpec, RunConfig, SlurmJob])
@pytest.mark.parametrize(
    ("field", "value"), [("name", "my job"), ("instance_type", "p5 48xlarge"), ("output_dir", 7)]
)
def test_a_bad_shared_value_is_one_line_naming_the_field(model: type, field: str, value: object) -> None:
    # In a job spec both parts check it by the same rule: said once.
    data = {"name": "job", field: value}
    with pytest.raises(SpecError) as info:
        parse_document(model, data, "job.yaml")
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"job.yaml: {field}: "), message


@pytest.mark.parametrize("key", ["nodez", "job", "run"])
def test_an_unknown_key_is_refused_with_every_key_of_a_spec(key: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_document(JobSpec, {"name": "x", key: 2}, "job.yaml")
    hint = "did you mean 'nodes'? " if key == "nodez" else ""
    assert str(info.value) == f"job.yaml: {key}: unknown key; {hint}known keys here: {', '.join(KEYS)}"


def test_problems_in_both_parts_are_named_as_written() -> None:
    data = {"name": "x", "nodes": 0, "checkpoint": {"memory": {"every": 0, "evry": 1}}}
    with pytest.raises(SpecError) as info:
        parse_document(JobSpec, data, "job.yaml")
    assert str(info.value).splitlines() == [
        "job.yaml: checkpoint.memory.every: 0 is not a number of steps: save every N steps with N >= 1, or auto",
        "job.yaml: checkpoint.memory.evry: unknown key; did you mean 'every'? known keys here: every, replicas",
        "job.yaml: nodes: Input should be greater than or equal to 1",
    ]
