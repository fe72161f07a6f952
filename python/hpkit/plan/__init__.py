"""`hpkit plan`: the layouts a model can run with on a cluster, their memory per GPU and their speed.

Torch-free: the planner runs on login nodes. `shapes` reads a model's shape, `layout` is one choice of
degrees, schedule, checkpointing, batch and precision, `memory` predicts each rank's peak from its parts,
`fixed_costs` holds the GPU-only constants per instance family.
"""

from hpkit.plan.layout import Layout
from hpkit.plan.memory import Breakdown, MemoryPlan, RankMemory, predict
from hpkit.plan.shapes import ModelShape, resolve_model, shape_named, shape_of_spec

__all__ = [
    "Breakdown",
    "Layout",
    "MemoryPlan",
    "ModelShape",
    "RankMemory",
    "predict",
    "resolve_model",
    "shape_named",
    "shape_of_spec",
]
