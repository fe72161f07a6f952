"""The package list and the templates' one home: what pyproject ships matches the source tree."""

from __future__ import annotations

from pathlib import Path

import tomllib

from hpkit.slurm import script

REPO = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_package_list_is_every_package_folder_plus_the_templates() -> None:
    on_disk = {
        ".".join(init.parent.relative_to(REPO / "python").parts)
        for init in (REPO / "python" / "hpkit").rglob("__init__.py")
    }
    assert set(SETUPTOOLS["packages"]) == on_disk | {"hpkit.templates"}


def test_templates_have_one_home_and_no_link_into_it() -> None:
    assert SETUPTOOLS["package-dir"]["hpkit.templates"] == "slurm/templates"
    assert not (REPO / "python" / "hpkit" / "templates").exists()
    links = [p for p in (REPO / "python").rglob("*") if p.is_symlink()]
    assert links == []
    assert script.TEMPLATE_DIR == REPO / "slurm" / "templates"
    shipped = SETUPTOOLS["package-data"]["hpkit.templates"]
    assert sorted(p.name for p in (REPO / "slurm" / "templates").iterdir()) == sorted(
        p.name for pattern in shipped for p in (REPO / "slurm" / "templates").glob(pattern)
    )
