"""A SageMaker estimator description, as a user writes it down from their `PyTorch(...)` call.

JSON or YAML with the estimator's keyword arguments (entry_point, instance_count, instance_type,
distribution, hyperparameters, ...). Only the shape is checked here; what each key means on Slurm is
decided in convert.py. Keys this model does not name are kept, so that each can be warned about.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Estimator(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    document_shape: ClassVar[str] = "an estimator description is a mapping (entry_point, instance_type, ...)"
    document_missing: ClassVar[str] = "copy it from the estimator's arguments"

    entry_point: str = Field(min_length=1)
    source_dir: str | None = None
    instance_count: int = Field(default=1, ge=1)
    instance_type: str = Field(min_length=1)
    distribution: dict[str, Any] = Field(default_factory=dict)
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    base_job_name: str | None = None
    max_run: int | None = Field(default=None, ge=1, description="seconds")
    max_retry_attempts: int | None = Field(default=None, ge=0)
    inputs: str | dict[str, str] | None = Field(
        default=None,
        description="what was passed to fit(): one URI (the 'training' channel) or channel -> URI",
    )

    @field_validator("distribution", "hyperparameters", "environment", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    def extra_keys(self) -> dict[str, Any]:
        return dict(self.model_extra or {})
