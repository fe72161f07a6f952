"""`hpkit plan --check-with-torch`: torch's own FSDP memory tracker on the model, for FSDP-only layouts.

The model is built by the runtime's own code (the family's adapter, activation checkpointing, FSDP2 with
the runtime's mixed-precision policy) on a fake process group of the layout's world size and under
FakeTensorMode, so no memory is allocated and no rank is started: torch's FSDPMemTracker follows one
rank through two training steps and reports its peak by category. It cannot follow TP, PP or EP there
(DTensor redistribution and the pipeline's point-to-point sends fail under FakeTensor in torch 2.13), so
those layouts are refused with one line; the analytic model (hpkit.plan.memory) covers them, and the
tests check it against this tracker where both run. Needs the train extra (torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpkit.errors import SpecError
from hpkit.models.llama.shape import ModelShape
from hpkit.plan.layout import Layout


@dataclass(frozen=True)
class TorchCheck:
    """One rank's peak as FSDPMemTracker saw it: total bytes and bytes per tracker category."""

    peak_bytes: int
    by_category: dict[str, int]


def check_with_torch(shape: ModelShape, layout: Layout) -> TorchCheck:
    """Run FSDPMemTracker on `shape` under `layout` (FSDP over dp_shard only); SpecError for other layouts."""
    if layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.dp_replicate > 1:
        raise SpecError(
            f"--check-with-torch follows FSDP-only layouts (dp_shard), not {layout.describe()}: torch's tracker "
            "cannot run TP, PP, EP or HSDP under FakeTensor; the planner's own model covers them"
        )
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SpecError("--check-with-torch needs torch: pip install 'hpkit[train]'") from None
    return _track(shape, layout)


def _llama_config(shape: ModelShape):
    from hpkit.models.llama.model import config_of_shape

    return config_of_shape(shape)


def _track(shape: ModelShape, layout: Layout) -> TorchCheck:
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpkit.models.adapters import adapter_for
    from hpkit.runtime.loop.loss import masked_loss_sum
    from hpkit.runtime.parallel.activation_checkpoint import apply_ac
    from hpkit.runtime.parallel.fsdp import apply_fsdp

    world = layout.dp_shard
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        adapter = adapter_for("moe" if shape.is_moe else "llama")
        with FakeTensorMode():
            model = adapter.build(_llama_config(shape), "meta")
            apply_ac(model, layout.activation_checkpoint, adapter)
            if world > 1:
                apply_fsdp(model, mesh, layout.precision, pp_enabled=False, adapter=adapter)
            else:
                # FSDPMemTracker needs an FSDP root; one shard keeps every weight whole, as no FSDP does.
                apply_fsdp(model, mesh, "fp32", pp_enabled=False, adapter=adapter)
            model.to_empty(device="cpu")
            # The runtime's AdamW is fused; under FakeTensor with bf16 FSDP the fused kernel is replaced by a
            # decomposition whose temporaries (several times the state) the tracker counts. The per-tensor
            # loop keeps the same state with one tensor's temporaries at a time.
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            tokens = torch.randint(0, shape.vocab_size, (layout.local_batch_size, shape.seq_len))
            labels = torch.randint(0, shape.vocab_size, (layout.local_batch_size, shape.seq_len))
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((tokens, labels))
            with tracker:
                for _ in range(2):  # the optimizer's state appears in the first step
                    loss_sum, _ = masked_loss_sum(model(tokens), labels)
                    (loss_sum / labels.numel()).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
            (peak,) = tracker.get_tracker_snapshot("peak").values()
    finally:
        if owns_group:
            dist.destroy_process_group()
    by_category = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if k != "Total"}
    return TorchCheck(peak_bytes=int(peak["Total"]), by_category=by_category)
