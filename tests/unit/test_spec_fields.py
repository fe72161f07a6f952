"""JobSpec is both a SlurmJob and a RunConfig: a key both declare must have one declaration, not two that
Python's MRO chooses between silently (different defaults, validators or descriptions)."""

from __future__ import annotations

import pytest

from hpkit.errors import SpecError
from hpkit.runtime.config import RunConfig
from hpkit.slurm_job import SlurmJob
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

SHARED = sorted(set(SlurmJob.model_fields) & set(RunConfig.model_fields))


def _declarers(field: str) -> list[str]:
    """The classes in JobSpec's MRO that declare `field` themselves (in their own class body)."""
    return [cls.__qualname__ for cls in JobSpec.__mro__ if field in vars(cls).get("__annotations__", {})]


def test_the_parents_share_the_identity_fields() -> None:
    # Guards the next test from passing vacuously: today these three are what both parents have.
    assert SHARED == ["instance_type", "name", "output_dir"]


@pytest.mark.parametrize("field", SHARED)
def test_a_shared_field_is_declared_once(field: str) -> None:
    assert len(_declarers(field)) == 1, f"{field} is declared by {_declarers(field)}: declare it once"


@pytest.mark.parametrize("field", SHARED)
def test_a_shared_field_reads_the_same_in_every_model(field: str) -> None:
    infos = {model.__name__: repr(model.model_fields[field]) for model in (SlurmJob, RunConfig, JobSpec)}
    assert len(set(infos.values())) == 1, infos


def test_only_a_bare_training_file_may_leave_out_the_name() -> None:
    assert parse_document(RunConfig, {}, "train.yaml").name == "train"
    for model in (SlurmJob, JobSpec):
        with pytest.raises(SpecError) as info:
            parse_document(model, {"nodes": 1}, "job.yaml")
        assert "name" in str(info.value)


@pytest.mark.parametrize("model", [JobSpec, RunConfig, SlurmJob])
@pytest.mark.parametrize(
    ("field", "value"), [("name", "my job"), ("instance_type", "p5 48xlarge"), ("output_dir", 7)]
)
def test_a_bad_shared_value_is_one_line_naming_the_field(model: type, field: str, value: object) -> None:
    data = {"name": "job", field: value}
    with pytest.raises(SpecError) as info:
        parse_document(model, data, "job.yaml")
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert f"{field}:" in message or f"{field} " in message, message
