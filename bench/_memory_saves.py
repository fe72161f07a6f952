"""What the in-memory checkpoint benches share (bench_memory_checkpoint.py over CPU ranks, gpu_memory_checkpoint.py
on one GPU): the order of their alternating blocks, and one training step with a save after it, timed in parts."""

from __future__ import annotations

import time
from typing import Any


def block_side(i: int) -> str:
    """The side of block i: none, memory, memory, none, none, memory, ... (each side first in every other pair)."""
    return ("none", "memory")[(i + i // 2) % 2]


def saved_step(trainer: Any, memory: Any, parts: dict[str, list[float]]) -> None:
    """A step, then a save: appends the optimizer's wait for the last save's staging copy (`staging`), the wait for
    the last save's write and copies, which save() makes first (`previous`), the background's time on those
    copies where `parts` has a `copy` list, and the save call (`call`)."""
    before = memory.staging_wait_s
    last = trainer.train_step(memory)
    parts["staging"].append(memory.staging_wait_s - before)
    t0 = time.perf_counter()
    memory.wait()
    parts["previous"].append(time.perf_counter() - t0)
    if "copy" in parts:
        parts["copy"].append(memory.copy_s)  # before the next save's background can change it
    t0 = time.perf_counter()
    memory.save(last.step, trainer.checkpoint_state())
    parts["call"].append(time.perf_counter() - t0)
