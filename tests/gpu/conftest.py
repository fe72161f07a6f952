"""The CUDA half of the suite: `make test-gpu` runs it on a machine with an NVIDIA GPU; `make test` never collects it.

Each test drives hpkit through its command line (`hpkit train`, `hpkit check`), so it checks what a user runs, and a
CPU reference comes from the same command with CUDA hidden (CUDA_VISIBLE_DEVICES="").
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def cuda_device() -> str:
    import torch

    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device: run them with `make test-gpu` on a GPU machine")
    return torch.cuda.get_device_name(0)
