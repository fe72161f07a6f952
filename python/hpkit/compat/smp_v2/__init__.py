"""SageMaker model parallel v2 (`torch.sagemaker`) on torch-native parallelism, opt-in per job (`compat: [smp_v2]`).

`install()` runs before the user's script (hpkit.run_script, when HPKIT_COMPAT names smp_v2): it lets
`import torch.sagemaker` find this layer (a real SMP v2 install, which lives inside torch's own package, still
wins) and makes `torch.distributed.fsdp.FullyShardedDataParallel` the FSDP2-based class v2 scripts need here.
"""

from __future__ import annotations

import sys

ENV = "HPKIT_COMPAT"


def install() -> None:
    from hpkit.compat.smp_v2.finder import TorchSagemakerFinder

    if TorchSagemakerFinder.real_install():
        return  # SageMaker's own library (inside torch's package folder) answers, untouched
    if not any(isinstance(f, TorchSagemakerFinder) for f in sys.meta_path):
        # First: the path finder would otherwise load the alias's submodules a second time, under torch's name.
        sys.meta_path.insert(0, TorchSagemakerFinder())
    import torch.distributed.fsdp as fsdp_pkg
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_module

    from hpkit.compat.smp_v2.fsdp import FullyShardedDataParallel

    fsdp_pkg.FullyShardedDataParallel = FullyShardedDataParallel
    fsdp_module.FullyShardedDataParallel = FullyShardedDataParallel
    from hpkit.compat.smp_v2 import te_fallback

    te_fallback.install()
