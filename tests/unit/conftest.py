"""Unit tests run many to a process (an xdist worker): one that leaves an HPKIT_ variable in os.environ changes
every later test of that worker, and the jobs those tests launch. A leaked HPKIT_WATCH_STORE once sent the next
integration module's hang drills to a store that was not there (five failures far from their cause)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def _hpkit_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("HPKIT_")}


@pytest.fixture(autouse=True)
def no_leaked_hpkit_environment() -> Iterator[None]:
    before = _hpkit_environment()
    yield
    after = _hpkit_environment()
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        for name in changed:  # put it back, so that only this test fails
            if name in before:
                os.environ[name] = before[name]
            else:
                os.environ.pop(name, None)
        pytest.fail(f"the test left HPKIT_ variables changed in os.environ: {changed} (use monkeypatch)")
