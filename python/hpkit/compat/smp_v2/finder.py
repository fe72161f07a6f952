"""`import torch.sagemaker[.x.y]` finds hpkit.compat.smp_v2.tsm[.x.y]: the same module object under both names."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
from types import ModuleType

PREFIX = "torch.sagemaker"
TARGET = "hpkit.compat.smp_v2.tsm"


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its hpkit name


class TorchSagemakerFinder(importlib.abc.MetaPathFinder):
    @staticmethod
    def real_install() -> bool:
        """Whether SageMaker's own torch.sagemaker is installed (inside torch's package folder)."""
        import torch

        return importlib.machinery.PathFinder.find_spec(PREFIX, list(torch.__path__)) is not None

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        name = TARGET + fullname[len(PREFIX) :]
        found = importlib.util.find_spec(name)
        if found is None:
            return None
        package = found.submodule_search_locations is not None
        spec = importlib.machinery.ModuleSpec(fullname, _Alias(name), is_package=package)
        if package:
            spec.submodule_search_locations = []  # submodules come through this finder, never a path
        return spec
