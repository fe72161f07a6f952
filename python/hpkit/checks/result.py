"""What a check returns: a verdict, one line of what was found, one line of how to fix it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
