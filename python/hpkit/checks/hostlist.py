"""Slurm's compressed host lists, written the way Slurm reads them: node[1-3,7],login1."""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def natural_key(name: str) -> tuple[str, int, str]:
    """node2 before node10, as Slurm orders them."""
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2)), name) if match else (name, -1, name)


def compress(names: Iterable[str]) -> str:
    """The shortest hostlist Slurm accepts for these names (--nodelist, --exclude); "" for none."""
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for name in names:
        match = _NUMBERED.match(name)
        if not match:
            plain.add(name)
            continue
        digits = match.group(2)
        # node01 and node1 are different names: zero-padded numbers keep their width.
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        groups.setdefault((match.group(1), width), set()).add(int(digits))
    parts = sorted(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        ordered = sorted(numbers)
        if len(ordered) == 1:
            parts.append(f"{prefix}{ordered[0]:0{width}d}")
            continue
        ranges = []
        start = prev = ordered[0]
        for number in [*ordered[1:], None]:
            if number is not None and number == prev + 1:
                prev = number
                continue
            ranges.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if number is not None:
                start = prev = number
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)
