"""Pydantic validation errors as the one-line-per-problem messages users see, each naming its field."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

from hpkit.errors import SpecError

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo must not silently fall back to a default); values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # What a whole document of this model is, for the message when it is not a mapping at all.
    document_shape: ClassVar[str] = "a mapping of keys"
    document_source: ClassVar[str] = "document"
    # Fields that are models whose keys the document writes at its own top level (a model made of parts while
    # its YAML stays flat: hpkit.spec.JobSpec). A problem inside one is named as the user wrote it, without
    # the part's name.
    flat_parts: ClassVar[tuple[str, ...]] = ()

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for a number field: `every: true` staged every step, `nodes: yes` asked for one.
        if isinstance(value, bool) and info.field_name is not None:
            accepted = _plain_types(cls.model_fields[info.field_name].annotation)
            if bool not in accepted and accepted & {int, float}:
                raise ValueError(f"a number, not {str(value).lower()}")
        return value


def _plain_types(annotation: Any) -> set[Any]:
    """The classes an annotation accepts at its top level (through unions, Optional, Annotated and Literal)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _plain_types(get_args(annotation)[0])
    if origin is Literal:
        return {type(value) for value in get_args(annotation)}
    if origin in (Union, UnionType):
        return set().union(*(_plain_types(arg) for arg in get_args(annotation)))
    return {origin or annotation}


def document_fields(model: Any) -> dict[str, FieldInfo]:
    """The keys a document of `model` has at its top level: its fields, or its flat parts' fields (none for
    what is not a model)."""
    fields = getattr(model, "model_fields", {})
    out: dict[str, FieldInfo] = {}
    for part in getattr(model, "flat_parts", ()):
        out.update(fields[part].annotation.model_fields)
    return out or dict(fields)


def check_no_control_chars(value: str, what: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain control characters (newlines, tabs, NUL)")
    return value


REQUIRED = "this field is required"
# How a key no model declares is named (describe_error); hpkit.spec.load_parts looks for it in a snapshot's errors.
UNKNOWN_KEY = "unknown key"


def describe_error(
    err: dict[str, Any], model: type[BaseModel], prefix: tuple[str, ...] = (), missing: str = REQUIRED
) -> str:
    """One problem as `field.path: message`; an unknown key gets the nearest known one suggested.

    `missing` is what a missing field's line says after `missing:` (the fix, where the caller knows it).
    """
    path = [str(p) for p in err["loc"]]
    if path and path[0] in getattr(model, "flat_parts", ()):
        path = path[1:]
    loc = [*prefix, *path]
    field = ".".join(loc)
    if err["type"] == "extra_forbidden":
        known = known_fields(model, path[:-1])
        hint = difflib.get_close_matches(loc[-1], known, n=1)
        suggestion = f"did you mean '{hint[0]}'? " if hint else ""
        return f"{field}: {UNKNOWN_KEY}; {suggestion}known keys here: {', '.join(known)}"
    if err["type"] == "missing":
        return f"{field}: missing: {missing}"
    msg = err["msg"].removeprefix("Value error, ")
    # Whole-model checks already start their message with the field they are about.
    return f"{field}: {msg}" if field else msg


def known_fields(model: type[BaseModel], path: list[str]) -> list[str]:
    current: Any = model
    for part in path:
        field = document_fields(current).get(part)
        if field is None:
            return []
        current = field.annotation
        for arg in getattr(current, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return sorted(document_fields(current))


def format_validation_error(
    exc: ValidationError,
    model: type[BaseModel],
    source: str,
    prefix: tuple[str, ...] = (),
    missing: str = REQUIRED,
) -> str:
    """Every problem in `exc`, one line each, prefixed by where the document came from.

    A line is said once: a model's flat parts may each check a key they share (JobSpec's name) by one rule."""
    lines = (f"{source}: {describe_error(e, model, prefix, missing)}" for e in exc.errors())
    return "\n".join(dict.fromkeys(lines))


def parse_document(model: type[ModelT], data: Any, source: str | None = None) -> ModelT:
    """A decoded document as `model`; SpecError with one line per problem, each naming its field.

    The one validate-or-SpecError boundary for every file a user writes (job spec, training config,
    SageMaker estimator). A model may say what its document is (`document_shape`, used when the data
    is not a mapping at all) and what a missing field's line should advise (`document_missing`).
    `source` names where the data came from (default: the model's `document_source`).
    """
    source = source or getattr(model, "document_source", "document")
    shape = getattr(model, "document_shape", "a mapping of keys")
    missing = getattr(model, "document_missing", REQUIRED)
    if not isinstance(data, dict):
        raise SpecError(f"{source}: {shape}, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, model, source, missing=missing)) from None


def read_document(path: str | Path) -> Any:
    """Decode a YAML (or, by suffix, JSON) file; SpecError names the file and line on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    try:
        # YAML is a superset of JSON, but JSON's own parser gives the better message for JSON files.
        document = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: line {exc.lineno} is not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}:{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:
        # Both parsers recurse once per level: a hostile file of 5,000 nested brackets ended in a traceback.
        raise SpecError(
            f"{path}: nested too deeply to read (lists or mappings about a thousand levels inside each other): "
            "a spec is a few levels deep"
        ) from None
    if count_values(document, MAX_VALUES) > MAX_VALUES:
        raise SpecError(
            f"{path}: holds more than {MAX_VALUES:,} values once its aliases (*name) are expanded: a spec or a "
            "sweep holds a few thousand; write the values out, or split the file"
        )
    return document


# The most values (mappings, lists and scalars, each alias counted where it is used) a document may expand to. YAML's
# aliases let 15 short lines stand for 387 million strings ("billion laughs"), which the spec's checks then walked
# for as long as they ran. Past it, the walk stops (values > MAX_VALUES is all it says).
MAX_VALUES = 1_000_000


def count_values(document: Any, limit: int) -> int:
    """How many values `document` holds, counting each alias where it is used, up to limit + 1."""
    count, stack = 0, [document]
    while stack and count <= limit:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def load_document(model: type[ModelT], path: str | Path) -> ModelT:
    """`parse_document` of a file."""
    return parse_document(model, read_document(path), str(path))
