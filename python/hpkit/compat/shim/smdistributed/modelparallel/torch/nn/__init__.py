"""smdistributed.modelparallel.torch.nn: SMP's own distributed layers have no honest equivalent here."""

from hpkit.compat.smp.unsupported import stop


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    stop(
        f"smp.nn.{name}",
        "use plain torch.nn layers marked with smp.set_tensor_parallelism (or torch's parallelize_module "
        "with ColwiseParallel/RowwiseParallel)",
    )
