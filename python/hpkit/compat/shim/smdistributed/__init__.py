"""hpkit's stand-in for SageMaker's `smdistributed` (on PYTHONPATH only for jobs with `compat:` set).

A real install elsewhere on sys.path always wins: this module then becomes that package (its search
path and its own __init__), and nothing below this folder is imported.
"""

import sys as _sys

from hpkit.shim_lookup import take_over as _take_over

_take_over(_sys.modules[__name__])
del _sys, _take_over
