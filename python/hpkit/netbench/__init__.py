"""Network benchmarks behind `hpkit bench` and `hpkit check --bandwidth`: collective bandwidth (torch.distributed,
nccl-tests) with nccl-tests' formulas, and pairwise node bandwidth. Named netbench, not bench: the repository's
top-level bench/ is the project's own benchmarks (`make bench`), a different thing."""
