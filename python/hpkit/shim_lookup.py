"""A real SageMaker install always wins over the shim: find it, and make the shim's package become it.

The shim's `smdistributed/__init__.py` runs this first. When another `smdistributed` (a regular or a
namespace package) is importable from the rest of sys.path, the shim's module takes over that package's
search locations and runs its `__init__`, so every `smdistributed.*` import from then on resolves to the
real library and none to hpkit's. Torch-free and cheap: it only looks at the file system.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "smdistributed"


def _same_dir(entry: str, shim_dir: Path) -> bool:
    try:
        return Path(entry or os.curdir).resolve() == shim_dir
    except OSError:
        return False


def find_real(shim_dir: Path, path: list[str]) -> importlib.machinery.ModuleSpec | None:
    """The spec of a `smdistributed` package on `path` outside `shim_dir`, or None."""
    shim_dir = shim_dir.resolve()
    others = [entry for entry in path if isinstance(entry, str) and not _same_dir(entry, shim_dir)]
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, others)
    if spec is None or spec.submodule_search_locations is None:
        return None  # none, or a lone module file, which cannot hold SageMaker's subpackages
    return spec


def hand_over(module: ModuleType, real: importlib.machinery.ModuleSpec) -> None:
    """Turn the shim's `smdistributed` module into the real package, in place (it is in sys.modules)."""
    locations = list(real.submodule_search_locations or [])
    # Subpackages are looked up on the parent's __path__; the spec's list is what importlib.reload reads.
    module.__path__ = locations
    if module.__spec__ is not None:
        module.__spec__.submodule_search_locations = locations
    if real.origin and real.has_location and real.origin.endswith(".py"):
        module.__file__ = real.origin
        source = Path(real.origin).read_text(encoding="utf-8")
        # Run the real package's own __init__ in the module every importer already holds.
        exec(compile(source, real.origin, "exec"), module.__dict__)


def take_over(module: ModuleType) -> bool:
    """The shim's first act: hand `module` (the shim's `smdistributed`) over to a real install; True if so."""
    shim_dir = Path(str(module.__file__)).resolve().parent.parent
    real = find_real(shim_dir, sys.path)
    if real is None:
        return False
    hand_over(module, real)
    return True


SHIM_INIT = ("hpkit", "compat", "shim", PACKAGE, "__init__.py")


def shim_answers() -> bool:
    """True when `import smdistributed` gives (or would give) hpkit's shim, not SageMaker's libraries.

    For `hpkit train`, which must not mistake the alias for SMDDP; it imports nothing to find out.
    """
    module = sys.modules.get(PACKAGE)
    if module is not None:
        return all(Path(p).parts[-4:] == SHIM_INIT[:-1] for p in getattr(module, "__path__", []))
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or Path(spec.origin).parts[-5:] != SHIM_INIT:
        return False
    return find_real(Path(spec.origin).resolve().parent.parent, sys.path) is None
