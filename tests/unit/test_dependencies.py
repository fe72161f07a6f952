"""Every module imports only the standard library and what its extra declares (deptry, configured in pyproject).

deptry checks a source tree against one set of declared dependencies. The per-extra check copies the modules
that need an extra ([tool.hpkit.extra-modules]) into a tree of their own and runs deptry there with the other
extras declared as development groups, which deptry reports (DEP004) when production code imports them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
EXTRA_MODULES: dict[str, list[str]] = PYPROJECT["tool"]["hpkit"]["extra-modules"]
EXTRAS = [name for name in PYPROJECT["project"]["optional-dependencies"] if name != "dev"]
SOURCES = sorted(p.relative_to(REPO / "python") for p in (REPO / "python" / "hpkit").rglob("*.py"))


def _deptry() -> str:
    found = shutil.which("deptry", path=str(Path(sys.executable).parent)) or shutil.which("deptry")
    if found is None:
        pytest.fail("deptry is not installed: it is in the dev extra (pip install -e '.[dev]')")
    return found


def _extra_of(module: Path) -> str:
    owners = [
        extra
        for extra, prefixes in EXTRA_MODULES.items()
        if any(module == Path(p) or Path(p) in module.parents for p in prefixes)
    ]
    assert len(owners) <= 1, f"{module} is listed under several extras: {owners}"
    return owners[0] if owners else "core"


def _check(extra: str, tree: Path, config: Path = REPO / "pyproject.toml") -> subprocess.CompletedProcess:
    for module in SOURCES:
        if _extra_of(module) == extra:
            (tree / module).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / "python" / module, tree / module)
    others = [name for name in EXTRAS if name != extra]
    return subprocess.run(
        [
            _deptry(),
            str(tree),
            "--config",
            str(config),
            "--optional-dependencies-dev-groups",
            ",".join(["dev", *others]),
            # A subset of the package need not use every declared package; the whole-package run checks that.
            "--ignore",
            "DEP002",
            "--no-ansi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_listed_module_exists() -> None:
    for extra, prefixes in EXTRA_MODULES.items():
        assert extra in EXTRAS, f"[tool.hpkit.extra-modules] names {extra}, which is no extra"
        for prefix in prefixes:
            assert (REPO / "python" / prefix).exists(), f"{extra}: {prefix} does not exist"


def test_whole_package_imports_are_declared_and_declarations_used() -> None:
    done = subprocess.run(
        [_deptry(), "python", "--no-ansi"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("extra", ["core", *EXTRAS])
def test_each_extra_declares_what_its_modules_import(extra: str, tmp_path: Path) -> None:
    done = _check(extra, tmp_path / "src")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_catches_an_import_only_another_extra_declares(tmp_path: Path) -> None:
    # Issue 19 as it was: runtime/loop/data.py imports numpy, which only the mpi extra declared.
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    declared = 'train = ["torch==2.13.0", "numpy", "prometheus-client>=0.20"]'
    assert declared in text
    config = tmp_path / "pyproject.toml"
    config.write_text(
        text.replace(declared, 'train = ["torch==2.13.0", "prometheus-client>=0.20"]'), encoding="utf-8"
    )
    done = _check("train", tmp_path / "src", config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DEP004 'numpy'" in done.stdout + done.stderr
