"""A sweep: one job spec run with several sets of overrides, as one Slurm job array (`hpkit submit --sweep`).

`--sweep train.lr=1e-4,3e-4 --sweep train.seed=1,2` is a grid (every combination, the first flag slowest);
`--sweep-file FILE` is a list of override mappings (one task each) or a mapping of keys to lists (a grid).
Each task's spec is the base spec with its overrides applied, then validated by the same validator as
`hpkit submit` (hpkit.validation.parse_document on JobSpec): a problem is one line naming the task and the
field, before anything is written or submitted.

One script serves every task, so only what `hpkit train` alone reads may differ between tasks: the training
blocks. Whatever reaches the script (the Slurm fields, name, output_dir, resilience) cannot be swept.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from hpkit import json_text
from hpkit.errors import SpecError
from hpkit.runtime.config import RunConfig
from hpkit.slurm.job import SlurmJob
from hpkit.spec import JobSpec
from hpkit.validation import MAX_VALUES, count_values, document_fields, parse_document, read_document

# RunConfig fields the rendered script reads (hpkit.render: the log's name and folder, the supervisor's plan).
_RENDERED = frozenset({"name", "output_dir", "resilience"})
SWEEPABLE = tuple(sorted(set(RunConfig.model_fields) - set(SlurmJob.model_fields) - _RENDERED))

Overrides = dict[str, Any]  # dotted key (train.lr) -> value

# The most tasks one sweep may have. Slurm's MaxArraySize is 1001 unless a cluster raises it (to 4,000,001 at most),
# every task's overrides are written into the one script (sbatch refuses scripts past 4 MB by default) and every
# task gets a spec snapshot: a 400 x 400 grid ran for minutes before writing 160,000 files.
MAX_TASKS = 10_000


@dataclass(frozen=True)
class SweepTask:
    index: int  # SLURM_ARRAY_TASK_ID
    overrides: Overrides
    spec: JobSpec  # the base spec with the overrides (and the task's own files) applied, validated

    def describe(self) -> str:
        return describe(self.overrides)


@dataclass(frozen=True)
class Sweep:
    """The override sets, one per task, and how many tasks may run at once (None: all)."""

    tasks: list[Overrides]
    max_parallel: int | None = None


def describe(overrides: Mapping[str, Any]) -> str:
    """`train.lr=0.0001 train.seed=1`: how a task's overrides are shown in tables and messages."""
    return " ".join(
        # default=str: YAML also reads dates and (!!set) sets, which JSON has no form for; the validator names them.
        f"{key}={json.dumps(value, default=str) if not isinstance(value, str) else value}"
        for key, value in overrides.items()
    )


def _split_values(text: str) -> list[str]:
    """Comma-separated values; commas inside [..] or {..} (a list or mapping value) do not split."""
    items, depth, current = [], 0, ""
    for char in text:
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item.strip() for item in items]


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_value(text: str) -> Any:
    """A value as YAML reads it, but `1e-4` is a number (YAML 1.1 wants `1.0e-4`)."""
    if _NUMBER.match(text) and not re.match(r"^[+-]?\d+$", text):
        return float(text)
    try:
        value = yaml.safe_load(text) if text else None
    except (yaml.YAMLError, RecursionError):  # the spec's validation then names the field
        return text
    # A flow value's aliases can stand for millions of values, as a file's can (hpkit.validation.MAX_VALUES).
    return text if count_values(value, MAX_VALUES) > MAX_VALUES else value


def parse_axis(text: str) -> tuple[str, list[Any]]:
    """`train.lr=1e-4,3e-4` -> ("train.lr", [0.0001, 0.0003]); SpecError names the problem."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"--sweep {text}: write KEY=VALUE[,VALUE...], e.g. --sweep train.lr=1e-4,3e-4")
    items = _split_values(values)
    if not any(items):
        raise SpecError(f"--sweep {key}: no values: give one or more, comma-separated (--sweep {key}=A,B)")
    if "" in items:
        raise SpecError(f"--sweep {key}: an empty value in {values!r}: remove the extra comma")
    return key, [parse_value(item) for item in items]


def grid(axes: Sequence[tuple[str, Sequence[Any]]]) -> list[Overrides]:
    """Every combination of the axes' values, the first axis slowest."""
    keys = [key for key, _ in axes]
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise SpecError(f"--sweep {twice}: given twice: give all its values in one --sweep")
    for key, values in axes:
        if not values:
            raise SpecError(f"sweep {key}: an empty list of values: give at least one")
    check_task_count(math.prod(len(values) for _, values in axes), "the grid")
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))]


def check_task_count(count: int, what: str) -> None:
    """SpecError past MAX_TASKS, before a task is made or checked."""
    if count > MAX_TASKS:
        raise SpecError(
            f"{what} has {count:,} tasks, more than a sweep's {MAX_TASKS:,} (Slurm's MaxArraySize is 1001 unless "
            "the cluster raises it): fewer values, or several sweeps"
        )


def _frozen(value: Any) -> Any:
    """A hashable form of an override's value that compares as the value does (1e-4 == 0.0001, 1 == 1.0)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, set):  # YAML's !!set
        return frozenset(_frozen(v) for v in value)
    return value


def read_sweep_file(path: str) -> list[Overrides]:
    """A list of override mappings (one task each), or a mapping of keys to lists of values (a grid)."""
    data = read_document(path)
    if isinstance(data, dict):
        axes = []
        for key, values in data.items():
            if not isinstance(values, list):
                raise SpecError(
                    f"{path}: {key}: a grid's values are a list (e.g. [1.0e-4, 3.0e-4]), "
                    f"not {type(values).__name__}"
                )
            axes.append((str(key), values))
        tasks = grid(axes)
    elif isinstance(data, list):
        check_task_count(len(data), path)
        tasks = []
        for number, entry in enumerate(data):
            if not isinstance(entry, dict):
                raise SpecError(
                    f"{path}: task {number}: a mapping of overrides (train.lr: 1.0e-4), not {type(entry).__name__}"
                )
            tasks.append({str(k): v for k, v in entry.items()})
    else:
        raise SpecError(
            f"{path}: a sweep file is a list of override mappings, or a mapping of keys to lists (a grid)"
        )
    if not tasks:
        raise SpecError(f"{path}: the sweep has no tasks: list at least one set of overrides")
    return tasks


def check_sweepable(key: str, where: str) -> None:
    """Fields that reach the one script (Slurm's, name, output_dir, resilience) are the same for every task."""
    top = key.split(".", 1)[0]
    if top in SWEEPABLE or top not in document_fields(JobSpec):
        return  # an unknown key is the spec validator's to name, with its suggestion
    raise SpecError(
        f"{where}: {key}: cannot be swept: every task of a job array shares its script, so {top} is the same "
        f"for all; sweep only {', '.join(SWEEPABLE)} (or submit one job per value)"
    )


def apply(data: Mapping[str, Any], overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`data` (a spec document) with each dotted key set to its value; blocks are created as needed."""
    out = copy.deepcopy(dict(data))
    for key, value in overrides.items():
        parts = key.split(".")
        if not all(parts):
            raise SpecError(f"{where}: {key}: an empty part in the key: write it as block.field (train.lr)")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                above = ".".join(parts[: depth + 1])
                raise SpecError(f"{where}: {key}: {above} is a value, not a block with fields")
            node = child
        node[parts[-1]] = copy.deepcopy(value)
    return out


def _own_files(data: dict[str, Any], index: int) -> dict[str, Any]:
    """Each task writes its own metrics file and checkpoints: names the spec fixes get the task's number
    (a %j in checkpoint.dir is the task's own id already: hpkit.runtime.run_identity)."""
    train = data.get("train")
    if isinstance(train, dict) and isinstance(train.get("metrics_file"), str):
        path = PurePosixPath(train["metrics_file"])
        train["metrics_file"] = str(path.with_name(f"{path.stem}.task{index}{path.suffix}"))
    checkpoint = data.get("checkpoint")
    if (
        isinstance(checkpoint, dict)
        and isinstance(checkpoint.get("dir"), str)
        and "%j" not in checkpoint["dir"]
    ):
        checkpoint["dir"] = str(PurePosixPath(checkpoint["dir"]) / f"task{index}")
    return data


def expand(base: Mapping[str, Any], sweep: Sweep, source: str) -> list[SweepTask]:
    """Every task's spec, validated as `hpkit submit` validates one; SpecError on the first bad task."""
    if not sweep.tasks:
        raise SpecError(f"{source}: the sweep has no tasks")
    if sweep.max_parallel is not None and sweep.max_parallel < 1:
        raise SpecError(f"--max-parallel {sweep.max_parallel}: must be 1 or more")
    check_task_count(len(sweep.tasks), source)
    out: list[SweepTask] = []
    seen: dict[Any, int] = {}  # each task's overrides, frozen -> its index
    for index, overrides in enumerate(sweep.tasks):
        where = f"{source}: sweep task {index} ({describe(overrides)})"
        if not overrides:
            raise SpecError(f"{where}: no overrides: every task sets at least one field")
        # Equal values, however written (1e-4 and 0.0001), make the same run: a task's compute for nothing.
        if (same := seen.setdefault(_frozen(overrides), index)) != index:
            raise SpecError(
                f"{where}: the same overrides as task {same}: it would train the same run twice; drop the "
                "repeated value (to repeat a run, give each its own train.seed)"
            )
        for key in overrides:
            check_sweepable(key, where)
        data = _own_files(apply(base, overrides, where), index)
        out.append(SweepTask(index, dict(overrides), parse_document(JobSpec, data, where)))
    return out


def sweep_manifest(tasks: Sequence[SweepTask], spec_pattern: str) -> str:
    """The sweep's file beside its script (HPKIT_SWEEP): each task's number, overrides and spec snapshot."""
    entries = [
        {"task": t.index, "overrides": t.overrides, "spec": spec_pattern.replace("%a", str(t.index))}
        for t in tasks
    ]
    return json.dumps({"tasks": entries}, indent=1) + "\n"


@dataclass(frozen=True)
class ManifestTask:
    index: int
    overrides: Overrides
    spec: str


def read_manifest(path: str) -> list[ManifestTask] | None:
    """The tasks a sweep's file lists, or None when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json_text.loads(handle.read())
        return [ManifestTask(int(t["task"]), dict(t["overrides"]), str(t["spec"])) for t in data["tasks"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
