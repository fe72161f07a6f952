"""smdistributed.modelparallel.torch, provided by hpkit.compat.smp (see there)."""

from hpkit.compat.smp import *  # noqa: F403 - this module is the SMP API's name for hpkit's
from hpkit.compat.smp import __all__ as __all__

# smp.nn.* (SMP's own distributed layers) stops with a line naming the torch-native way.
from . import nn as nn
