"""What a model and a layout are, as plain numbers: torch-free, so the planner runs on login nodes.

The runtime (hpkit.runtime, hpkit.models, hpkit.hf) and the planner (hpkit.plan) both import this package, and
nothing here imports either: each rule below has this one home, and neither side keeps a copy.

- families: the model families `hpkit train` builds and the shape names each answers to (`model.name`);
- llama/: the Llama family and its mixture-of-experts variant: the named shapes (named), a shape's parameter
  and FLOP counts and the rules it must meet (shape), and Hugging Face's config.json read into one (hf);
- pipeline: the schedule names, which stages a pp rank holds, which blocks a stage holds, and the settings
  torch's schedules refuse (stage count, microbatches);
- parallel: what the tensor and expert parallel degrees must divide.

A new model family is a folder here beside llama/ (its shapes table, its shape's counts and rules, its
config.json reading), its shape names in families.FAMILIES, its torch modules in hpkit.models, and its adapter
(build, split, TP plan, Hugging Face tensor names) in hpkit.runtime.adapters.
"""
