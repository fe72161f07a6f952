"""hpkit's stand-in for `smdistributed.dataparallel`: only the PyTorch API (`.torch`) is provided."""
