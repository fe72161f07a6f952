"""Where Transformer Engine is absent, `import transformer_engine` gets a stand-in: fp8_autocast runs the block
as it is (bf16 where the script asked for it), DelayedScaling and Format are accepted, and one line at import
says so. A real install always wins: the stand-in is only registered when none can be found."""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any


class Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class DelayedScaling:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


@contextlib.contextmanager
def fp8_autocast(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield


def install() -> None:
    if "transformer_engine" in sys.modules or importlib.util.find_spec("transformer_engine") is not None:
        return
    root = types.ModuleType("transformer_engine")
    root.__path__ = []
    common = types.ModuleType("transformer_engine.common")
    common.__path__ = []
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.fp8_autocast = fp8_autocast

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        kwargs.pop("distribute_saved_activations", None)
        kwargs.pop("tp_group", None)
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)

    pytorch.checkpoint = checkpoint
    root.common, common.recipe, root.pytorch = common, recipe, pytorch
    for module in (root, common, recipe, pytorch):
        sys.modules[module.__name__] = module
    for module in (root, common, recipe, pytorch):
        # A module in sys.modules without a spec makes importlib.util.find_spec raise ValueError, which is
        # how other libraries probe for Transformer Engine (peft, imported by transformers.set_seed's module).
        module.__spec__ = importlib.machinery.ModuleSpec(
            module.__name__, None, is_package=hasattr(module, "__path__")
        )
    root._hpkit_stand_in = True


def announce() -> None:
    """One line, from the first rank that reads the fp8 settings, when the stand-in answers."""
    if getattr(sys.modules.get("transformer_engine"), "_hpkit_stand_in", False):
        print("tsm: Transformer Engine is not installed: FP8 falls back to bf16", file=sys.stderr, flush=True)
