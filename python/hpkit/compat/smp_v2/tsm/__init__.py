"""`torch.sagemaker` as hpkit's SMP v2 layer answers it (hpkit.compat.smp_v2.finder maps the names here).

`import torch.sagemaker as tsm; tsm.init(config); model = tsm.transform(model)`; `tsm.state` answers the rank
and size queries scripts make.
"""

from hpkit.compat.smp_v2.state import StateProxy, init
from hpkit.compat.smp_v2.transform import transform

__version__ = "2.0.0+hpkit"
state = StateProxy()

__all__ = ["init", "state", "transform"]
