"""Message sizes the way nccl-tests takes them: `-b 8 -e 8G -f 2`, with K/M/G as powers of 1024."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"^(\d+)\s*([KMGT]?)(?:I?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8' -> 8, '64K' -> 65536, '8G' -> 8 GiB; raises ValueError with the accepted forms."""
    match = _SIZE.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size: use bytes with an optional K, M or G (e.g. 8, 64K, 8G)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return value


def sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min*f, min*f^2, ... up to max, as nccl-tests steps by a factor."""
    if min_bytes > max_bytes:
        raise ValueError(f"the smallest size ({min_bytes} B) is larger than the largest ({max_bytes} B)")
    if factor < 2:
        raise ValueError(f"the step factor must be at least 2, not {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def human(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)
