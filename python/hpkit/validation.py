"""Pydantic validation errors as the one-line-per-problem messages users see, each naming its field."""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from hpkit.errors import SpecError

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo must not silently fall back to a default); values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def check_no_control_chars(value: str, what: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain control characters (newlines, tabs, NUL)")
    return value


REQUIRED = "this field is required"


def describe_error(
    err: dict[str, Any], model: type[BaseModel], prefix: tuple[str, ...] = (), missing: str = REQUIRED
) -> str:
    """One problem as `field.path: message`; an unknown key gets the nearest known one suggested.

    `missing` is what a missing field's line says after `missing:` (the fix, where the caller knows it).
    """
    loc = [*prefix, *(str(p) for p in err["loc"])]
    field = ".".join(loc)
    if err["type"] == "extra_forbidden":
        known = known_fields(model, [str(p) for p in err["loc"]][:-1])
        hint = difflib.get_close_matches(loc[-1], known, n=1)
        suggestion = f"did you mean '{hint[0]}'? " if hint else ""
        return f"{field}: unknown key; {suggestion}known keys here: {', '.join(known)}"
    if err["type"] == "missing":
        return f"{field}: missing: {missing}"
    msg = err["msg"].removeprefix("Value error, ")
    # Whole-model checks already start their message with the field they are about.
    return f"{field}: {msg}" if field else msg


def known_fields(model: type[BaseModel], path: list[str]) -> list[str]:
    current: Any = model
    for part in path:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
        for arg in getattr(current, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return sorted(getattr(current, "model_fields", {}))


def format_validation_error(
    exc: ValidationError,
    model: type[BaseModel],
    source: str,
    prefix: tuple[str, ...] = (),
    missing: str = REQUIRED,
) -> str:
    """Every problem in `exc`, one line each, prefixed by where the document came from."""
    return "\n".join(f"{source}: {describe_error(e, model, prefix, missing)}" for e in exc.errors())


def validate_document(
    model: type[ModelT], data: Any, source: str, shape: str, missing: str = REQUIRED
) -> ModelT:
    """A decoded document as `model`; SpecError with one line per problem, each naming its field.

    `shape` says what the document is when it is not a mapping at all ("a job spec is a mapping of keys
    (name, nodes, ...)")."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: {shape}, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, model, source, missing=missing)) from None
