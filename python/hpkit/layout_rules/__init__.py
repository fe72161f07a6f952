"""What a layout must satisfy, as plain numbers: torch-free, so the planner runs on login nodes.

The runtime (hpkit.runtime, hpkit.models) and the planner (hpkit.plan) both import this package, and nothing here
imports either: each rule below has this one home, and neither side keeps a copy.

- pipeline: the schedule names, which stages a pp rank holds, which blocks a stage holds, and the settings
  torch's schedules refuse (stage count, microbatches);
- parallel: what the tensor and expert parallel degrees must divide.

What a model is (its shapes, counts and config.json) lives with its family, in hpkit.models.<family>/.
"""
