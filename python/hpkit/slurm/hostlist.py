"""Slurm's compressed host lists, read and written the way Slurm does: node[1-3,7],login1.

Expanded here rather than by `scontrol show hostnames` (one process per call, and a slurm.conf to read), with
Slurm's rules as 22.05's scontrol applies them (tests/unit/test_hostlist.py): entries split on commas and
whitespace outside brackets, in the order given, duplicates kept; a range's width is its first number's
(n[08-10] -> n08 n09 n10, a[8-010] -> a8 a9 a10); several brackets multiply, the last varying fastest, then
the first, the second, ... (x[1-2]y[3-4] -> x1y3 x1y4 x2y3 x2y4; a[1-2]b[1-2]c[1-2] -> a1b1c1 a1b1c2 a2b1c1 ...).
Slurm 22.05 refuses a suffix after the last bracket (n[1-3]-ib) and later releases read it; it is read here (it only
widens what is accepted).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from hpkit.errors import SlurmError

_NUMBERED = re.compile(r"^(.*?)(\d+)$", re.ASCII)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


class HostlistError(SlurmError):
    """A host list Slurm would refuse."""


# More names than any Slurm cluster has: a list past it is a typo (n[1-10000000]) or hostile, and is refused
# before it is written out, rather than expanded into millions of names.
MAX_HOSTS = 65536


def expand(hostlist: str) -> list[str]:
    """Slurm's host list as names: 'node[1-3,7],login1' -> node1, node2, node3, node7, login1."""
    names: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(hostlist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise HostlistError(f"invalid host list {hostlist!r}: unbalanced brackets")
        if (char == "," or char.isspace()) and depth == 0:
            if item := hostlist[start:i]:
                names += _expand_one(item, hostlist)
                _bounded(len(names), hostlist)
            start = i + 1
    if depth:
        raise HostlistError(f"invalid host list {hostlist!r}: unbalanced brackets")
    return names


def first(hostlist: str) -> str | None:
    """The first name of a host list ('node[3-5,9],gpu1' -> 'node3'), None when it names none or is not one."""
    try:
        return next(iter(expand(hostlist)), None)
    except HostlistError:
        return None


def _expand_one(item: str, whole: str) -> list[str]:
    texts, brackets = [], []
    rest = item
    while True:
        text, bracket, rest = rest.partition("[")
        texts.append(text)
        if not bracket:
            break
        ranges, _, rest = rest.partition("]")
        brackets.append(_numbers(ranges, whole))
    if not brackets:
        return [item]
    _bounded(math.prod(len(numbers) for numbers in brackets), whole)
    # Slurm's order (22.05's scontrol): the last bracket varies fastest, then the first, the second, ... (a[1-2]
    # b[1-2]c[1-2]: a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...); with two brackets, the first outermost.
    heads = [texts[0]]
    for numbers, text in zip(brackets[:-1], texts[1:-1], strict=True):
        heads = [head + number + text for number in numbers for head in heads]
    return [head + number + texts[-1] for head in heads for number in brackets[-1]]


def _numbers(ranges: str, whole: str) -> list[str]:
    """One bracket's numbers, as written: '08-10,12' -> 08 09 10 12 (a range's width is its first number's)."""
    out = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part)
        if match is None or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise HostlistError(f"invalid host list {whole!r}: {part!r} is not a range (N or N-M, N <= M)")
        low, high = match.group(1), match.group(2) or match.group(1)
        _bounded(len(out) + int(high) - int(low) + 1, whole)
        out += [str(number).zfill(len(low)) for number in range(int(low), int(high) + 1)]
    return out


def _bounded(count: int, whole: str) -> None:
    if count > MAX_HOSTS:
        raise HostlistError(f"invalid host list {whole!r}: more than {MAX_HOSTS:,} hosts")


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
