"""What names a job and where it writes: the fields a Slurm job and a run configuration share.

`SlurmJob` and `RunConfig` are each a document of their own (nccl-tests and the all-nodes check; `hpkit train
--config`), and `JobSpec` (hpkit.spec) holds one of each, giving both these keys from its one flat YAML. Each
shared field is declared here once, so the two parts cannot disagree on its default, validator or description;
tests/unit/test_spec_fields.py fails when a part declares it again.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from hpkit.validation import StrictModel

# A job name and an instance type land in `#SBATCH` lines and in file names: plain tokens only.
SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class JobIdentity(StrictModel):
    """The job's name, its output directory and the instance type its nodes are."""

    # The name a document without `name` gets; None: the name is required. A file of bare training blocks
    # (RunConfig) may omit it; a Slurm job, and so a job spec, must name itself.
    default_name: ClassVar[str | None] = None

    name: str = Field(description="the job's name: Slurm's job name, and the stem of its run's files")
    output_dir: str = Field(default="logs", description="where the job's logs, metrics and hang reports go")
    instance_type: str | None = Field(
        default=None,
        description=(
            "the EC2/SageMaker type the nodes are (ml.p4d.24xlarge): gives GPUs and vCPUs, and informs SMDDP"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if cls.default_name is not None and isinstance(data, dict) and "name" not in data:
            return {**data, "name": cls.default_name}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not SLURM_NAME.match(value):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' (at most 128, starting with a letter or digit)"
            )
        return value

    @field_validator("instance_type")
    @classmethod
    def _instance_type(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_NAME.match(value):
            raise ValueError("an instance type such as ml.p4d.24xlarge or p5.48xlarge")
        return value
