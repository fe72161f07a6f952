"""`torch.sagemaker.checkpoint.utils`: keeping the newest N checkpoint folders."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path


def SORT_BY_LAST_INT(name: str) -> int:
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else -1


def limit_num_subdirs(
    root: str | os.PathLike,
    num_to_keep: int,
    sort_fn: Callable[[str], int] = SORT_BY_LAST_INT,
    regex: str = r".*",
    log: bool = False,
) -> list[str]:
    """Remove all but the newest `num_to_keep` subfolders matching `regex`; call it from one rank."""
    if num_to_keep is None or num_to_keep < 1:
        return []
    folders = sorted(
        (p.name for p in Path(root).iterdir() if p.is_dir() and re.match(regex, p.name)), key=sort_fn
    )
    removed = folders[:-num_to_keep]
    for name in removed:
        shutil.rmtree(Path(root, name), ignore_errors=True)
        if log:
            print(f"tsm: removed checkpoint {name}", flush=True)
    return removed
