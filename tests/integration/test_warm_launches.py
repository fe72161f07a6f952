"""The suite's own warm launches (tests/integration/_torchrun.py): a zygote outlives the launches that started it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import _torchrun
import pytest


def test_a_zygote_started_inside_run_together_serves_the_launches_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_together starts its launches on a pool's threads, and a zygote dies with the thread that started it
    (PR_SET_PDEATHSIG): one started there must still serve once the pool has ended, or every later launch with
    its start-up variables runs cold. A start-up variable of this test's own gives it a zygote of its own."""
    own = {"PYTHONHASHSEED": str(uuid.uuid4().int % 4_000_000_000)}
    # Room for it beside the zygotes this worker's earlier tests started, whatever their number.
    monkeypatch.setattr(_torchrun._Zygote, "MAX_ZYGOTES", len(_torchrun._Zygote.running) + 1)
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    done = _torchrun.run_together({tag: ([str(script)], tmp_path / tag, None, own) for tag in ("a", "b")})
    assert all(d.stdout == "hello\n" for d in done.values()), done
    env = _torchrun.torch_env(tmp_path / "after") | own
    key = _torchrun._Zygote.key(env)
    try:
        zygote = _torchrun._Zygote.running[key]
        assert zygote is not None, "the launches' zygote did not come up"
        # SIGKILL from the kernel when its starting thread ended comes at once; a second leaves room for a load.
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.proc.wait(timeout=1)
        assert _torchrun.warm([sys.executable, str(script)], env)[1:3] == ["-m", "hpkit.warm.client"]
    finally:
        zygote = _torchrun._Zygote.running.pop(key, None)  # its slot back for the tests after this one
        if zygote is not None:
            zygote.stop()
