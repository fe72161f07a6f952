"""SMDDP (`smdistributed.dataparallel.torch`) on hpkit: the "smddp" backend as an alias of NCCL or gloo."""
