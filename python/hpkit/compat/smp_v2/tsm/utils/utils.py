"""`torch.sagemaker.utils.utils`: the helpers scripts call."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def timeit(enabled: bool = True, what: str = "", rank: int = 0) -> Iterator[None]:
    """How long the block took, printed by rank 0."""
    start = time.perf_counter()
    yield
    if enabled and rank == 0:
        print(f"tsm: {what} took {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
