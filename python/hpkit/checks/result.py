"""What a check returns: a verdict, one line of what was found, one line of how to fix it, and the facts
behind the verdict (versions, counts) so that `hpkit check --all-nodes` can compare nodes with each other."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Result:
    status: Status
    detail: str
    fix: str = ""
    # JSON-ready values (str, int, list of str, None) under names unique across all checks: gpu_count,
    # driver, kernel, ... A node whose facts differ from the other nodes' is suspect even when it passes.
    facts: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def with_facts(self, **facts: Any) -> Result:
        return replace(self, facts={**self.facts, **facts})

    @classmethod
    def ok(cls, detail: str) -> Result:
        return cls(Status.PASS, detail)

    @classmethod
    def warn(cls, detail: str, fix: str) -> Result:
        return cls(Status.WARN, detail, fix)

    @classmethod
    def fail(cls, detail: str, fix: str) -> Result:
        return cls(Status.FAIL, detail, fix)

    @classmethod
    def skip(cls, detail: str, fix: str = "") -> Result:
        return cls(Status.SKIP, detail, fix)
