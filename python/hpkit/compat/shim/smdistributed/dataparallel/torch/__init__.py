"""hpkit's stand-in for `smdistributed.dataparallel.torch` (compat: [smddp])."""
