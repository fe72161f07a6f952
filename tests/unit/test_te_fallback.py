"""The Transformer Engine stand-in of the SMP v2 layer must look like a module to libraries that probe for it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib.util
from hpkit.compat.smp_v2 import te_fallback
te_fallback.install()
spec = importlib.util.find_spec("transformer_engine")  # raised ValueError while the stand-in had no spec
assert spec is not None and spec.name == "transformer_engine", spec
assert importlib.util.find_spec("transformer_engine.pytorch") is not None
import transformer_engine.pytorch as te_pytorch
assert te_pytorch.fp8_autocast is not None
try:
    import peft  # noqa: F401  (transformers.set_seed's module imports it, and it probes for the stand-in)
except ImportError:
    pass
print("ok")
"""


def test_the_stand_in_answers_find_spec_and_lets_peft_import() -> None:
    # A fresh interpreter: the stand-in goes into sys.modules for good.
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
