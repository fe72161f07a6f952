"""A process becoming the one a warm client asked for: its CPUs, signal dispositions, umask, environment,
folder, stdin, stdout and stderr, and fresh random state. A forked rank does it once (hpkit.warm.zygote); a
parked rank that a later step adopts does it again (hpkit.warm.park). Standard library only."""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import sys
import tempfile
from typing import Any


def become(request: dict[str, Any], fds: list[int]) -> None:
    """Take on what `request` (the client's) names, with `fds` its stdin, stdout and stderr."""
    if (cpus := request.get("cpus")) is not None:
        os.sched_setaffinity(0, cpus)
    _signals(request.get("ignored_signals") or [])
    os.umask(int(request.get("umask", 0o022)))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
    # tempfile keeps the folder it found first (torch's import asks): the rank's TMPDIR decides again.
    tempfile.tempdir = None
    os.chdir(request.get("cwd") or "/")
    _descriptors(request.get("fds") or [], fds)
    _streams(os.environ)
    random.seed()
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()


def _signals(ignored: list[int]) -> None:
    """The dispositions python starts with, and what the client's parent had ignored ignored still."""
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(ValueError):
            signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in ignored:
        with contextlib.suppress(ValueError):
            signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _descriptors(targets: list[int], fds: list[int]) -> None:
    for target, fd in zip(targets, fds, strict=True):
        os.dup2(fd, target)
        if fd != target:
            os.close(fd)
    for target in (0, 1, 2):
        if target not in targets:
            with contextlib.suppress(OSError):
                os.close(target)


def _streams(env: dict[str, str] | os._Environ[str]) -> None:
    """sys.stdin, stdout and stderr anew on the rank's descriptors: a terminal or a pipe decides their buffering,
    and PYTHONUNBUFFERED, as at an interpreter's start."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"

    def stream(fd: int, write: bool, errors: str) -> io.TextIOWrapper | None:
        try:
            os.fstat(fd)
        except OSError:
            return None
        raw = io.FileIO(fd, "w" if write else "r", closefd=False)
        buffered: Any = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
        tty = raw.isatty()
        return io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors=errors,
            line_buffering=write and (tty or fd == 2),
            write_through=write and unbuffered,
        )

    sys.stdin = sys.__stdin__ = stream(0, False, "strict")  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = stream(1, True, "strict")  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace")  # type: ignore[misc]
