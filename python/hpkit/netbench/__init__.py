"""Cluster validation benchmarks: collective bandwidth (torch.distributed, nccl-tests) with nccl-tests' formulas."""
