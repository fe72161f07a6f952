"""`import smdistributed.dataparallel.torch.torch_smddp` registers the "smddp" backend: here, hpkit's alias.

Rank 0 says in one line that it is an alias and why; a spec that insists on SageMaker's library
(collectives.smddp_fallback: false) stops every rank here, before any process group exists.
"""

from hpkit.compat.smddp import backend as _backend
from hpkit.compat.smddp import policy as _policy

_policy.check(_backend.alias_target())
_backend.register()

# hpkit's runtime tells the alias from SageMaker's library by this (and by where the module lives).
HPKIT_ALIAS = True
