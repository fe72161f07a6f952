"""What a model and a layout are, as plain numbers: torch-free, so the planner runs on login nodes.

The runtime (hpkit.runtime, hpkit.models, hpkit.hf) and the planner (hpkit.plan) both import this package and
nothing here imports either: each rule has its one home here.

- pipeline: the schedule names, which stages a pp rank holds, which blocks a stage holds, and the settings
  torch's schedules refuse (stage count, microbatches);
- parallel: what the tensor and expert parallel degrees must divide.
"""
