"""smdistributed.modelparallel.torch, provided by hpkit.compat.smp (see there)."""

from hpkit.compat.smp import *  # noqa: F403 - this module is the SMP API's name for hpkit's
from hpkit.compat.smp import __all__ as __all__
