"""argparse value types shared by the commands and by the library's own `python -m` entry points.

Torch-free and at the bottom of the import graph, so that a library module with a command line of its
own (hpkit.netbench.pairs) need not import a command module to parse its flags.
"""

from __future__ import annotations

import argparse

from hpkit.sizes import parse_size


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def byte_size(text: str) -> int:
    """A size such as 16M or 8G, in bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
