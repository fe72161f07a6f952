"""Helpers shared by checks: run a command with a timeout, find a program, parse version strings."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpkit.slurm.client import Answer, program


@dataclass(frozen=True)
class CmdResult:
    """How a command ended. error is set when it could not run or ran past its timeout."""

    rc: int | None
    out: str
    err: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.rc == 0

    def why(self) -> str:
        """One line saying why the command did not succeed."""
        if self.error:
            return self.error
        lines = [line.strip() for line in (self.err or self.out).splitlines() if line.strip()]
        # Slurm prints several `error:` lines before the `fatal:` one that names the cause.
        fatal = [line for line in lines if "fatal" in line.lower()]
        last = (fatal or lines or [f"exit status {self.rc}"])[-1]
        return f"exit status {self.rc}: {last}" if lines else last


def run_cmd(args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> CmdResult:
    try:
        proc = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return CmdResult(None, "", "", f"{args[0]} not found")
    except PermissionError:
        return CmdResult(None, "", "", f"{args[0]} is not executable")
    except subprocess.TimeoutExpired:
        return CmdResult(None, "", "", f"`{' '.join(args)}` did not finish within {timeout:g} s")
    except OSError as exc:
        return CmdResult(None, "", "", f"{args[0]}: {exc.strerror or exc}")
    return CmdResult(proc.returncode, proc.stdout, proc.stderr)


def slurm_result(answer: Answer, timeout: float) -> CmdResult:
    """A Slurm command's answer (hpkit.slurm.client, the one place that runs them) in a check's words."""
    if answer.missing:
        return CmdResult(None, "", "", f"{answer.args[0]} not found")
    if answer.timed_out:
        return CmdResult(None, "", "", f"`{answer.command}` did not finish within {timeout:g} s")
    if answer.rc is None:
        return CmdResult(None, "", "", f"{answer.args[0]}: {answer.os_error}")
    return CmdResult(answer.rc, answer.out, answer.err)


def which(name: str, env: Mapping[str, str], extra_dirs: Iterable[Path] = ()) -> str | None:
    """The program on the environment's PATH, else in one of extra_dirs (where installers put it): the Slurm
    client's lookup, which finds the Slurm commands the same way."""
    return program(name, env, extra_dirs)


_VERSION = re.compile(r"(\d+(?:\.\d+)*)")


def parse_version(text: str) -> tuple[int, ...] | None:
    """The leading dotted number of a version string: '2.13.0+cu121' -> (2, 13, 0)."""
    match = _VERSION.search(text or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def fmt_version(version: Sequence[int]) -> str:
    return ".".join(str(part) for part in version)


def at_least(found: Sequence[int], wanted: Sequence[int]) -> bool:
    width = max(len(found), len(wanted))
    return tuple(found) + (0,) * (width - len(found)) >= tuple(wanted) + (0,) * (width - len(wanted))


def read_text(path: Path, limit: int = 1 << 20) -> str | None:
    """A small file's text, or None when it is missing or unreadable (a check reports that itself)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(limit)
    except OSError:
        return None


def distributions(path: Sequence[str], name: str) -> list[Any]:
    """Installed distributions called name on path, without importing them."""
    # Imported here: importlib.metadata is new in 3.8, and the login profile never needs it, so an older
    # system Python still gets as far as the python check that reports it.
    import importlib.metadata

    return list(importlib.metadata.distributions(name=name, path=list(path)))
