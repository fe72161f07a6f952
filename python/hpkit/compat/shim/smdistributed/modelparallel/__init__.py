"""smdistributed.modelparallel, provided by hpkit: only the PyTorch API (`.torch`)."""
