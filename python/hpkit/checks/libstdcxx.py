"""libstdc++ as this process gets it: the loader picks it (LD_LIBRARY_PATH, conda's RPATH, the system), so
load it the same way, ask /proc/self/maps which file that was, and read the GLIBCXX versions it defines.
A too-old one shows up at training time as `GLIBCXX_3.4.30 not found`."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from hpkit.checks.context import Context
from hpkit.checks.probe import fmt_version, parse_version, read_text
from hpkit.checks.registry import check
from hpkit.checks.result import Result

REQUIRED = (3, 4, 30)
_SYMBOL_VERSION = re.compile(rb"GLIBCXX_(\d+\.\d+(?:\.\d+)?)\x00")


def loaded_libstdcxx(proc_self: Path) -> str | None:
    """Path of the libstdc++ mapped into this process, per (proc_self)/maps."""
    text = read_text(proc_self / "maps", limit=8 << 20) or ""
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and "/libstdc++.so" in fields[5]:
            return fields[5].strip()
    return None


def glibcxx_versions(library: Path) -> list[tuple[int, ...]]:
    """The GLIBCXX_x.y.z symbol versions a libstdc++ file defines, oldest first."""
    with open(library, "rb") as handle:
        data = handle.read()
    found = {parse_version(m.group(1).decode()) for m in _SYMBOL_VERSION.finditer(data)}
    return sorted(v for v in found if v)


_FIX = (
    "give the process a newer libstdc++ (GCC ≥ 12): in conda `conda install -c conda-forge 'libstdcxx-ng>=12'`; "
    "otherwise put a newer one first, e.g. `export LD_LIBRARY_PATH=$CONDA_PREFIX/lib:$LD_LIBRARY_PATH`, "
    "or train in the hpkit image (docker/Dockerfile)"
)


@check("libstdcxx", "libstdc++ has GLIBCXX_3.4.30", profiles=("compute", "container"))
def libstdcxx(ctx: Context) -> Result:
    try:
        ctypes.CDLL("libstdc++.so.6")
    except OSError as exc:
        return Result.fail(f"the loader finds no libstdc++.so.6: {exc}", _FIX)
    path = loaded_libstdcxx(ctx.roots.proc_self)
    if path is None:
        return Result.fail("libstdc++.so.6 loaded, but it is not in /proc/self/maps", _FIX)
    try:
        versions = glibcxx_versions(Path(path))
    except OSError as exc:
        return Result.fail(f"cannot read {path}: {exc.strerror or exc}", _FIX)
    if not versions:
        return Result.fail(f"{path} defines no GLIBCXX symbol versions", _FIX)
    newest = fmt_version(versions[-1])
    if REQUIRED in versions:
        return Result.ok(f"{path} provides up to GLIBCXX_{newest}")
    return Result.fail(f"{path} provides only up to GLIBCXX_{newest}; need GLIBCXX_3.4.30", _FIX)
