"""SMDDP (`smdistributed.dataparallel.torch`) on hpkit: the "smddp" backend as an alias of NCCL or gloo.

Only reached through the shim (spec `compat: [smddp]`) when SageMaker's SMDDP library is not installed:
a real install takes the shim's place (hpkit.shim_lookup). policy.py decides, torch-free, whether the
job may run on the alias and what to say; backend.py registers the alias with torch.distributed.
"""
