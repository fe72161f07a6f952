"""The model families `hpkit train` builds: one folder each (as torchtitan's models/<family>/), and what every
family answers to.

- families: the family names and the shape names each answers to (`model.name`); torch-free;
- adapter: what the runtime asks of a family (ModelAdapter) and its Hugging Face format (HfMapping); torch-free;
- adapters: the registry, a family's adapter by family, shape name or built model;
- tp_styles: the tensor-parallel pieces every family's plan may use;
- llama/: Llama and its mixture-of-experts variant, from its torch-free shapes to its adapter.

A family's folder holds, torch-free, its named shapes, its shape's parameter and FLOP counts and rules, and its
config.json reading (the planner imports these on login nodes, and the runtime builds from the same ones, so the
two cannot disagree); then its torch modules, its Hugging Face tensor names, and its adapter (build, split,
tensor-parallel plan). A new family is a new folder beside llama/, a line in families.FAMILIES and one in
adapters.ADAPTERS. This package and a family's own __init__ import nothing, so a login node that reads a
family's shapes never imports torch.
"""
