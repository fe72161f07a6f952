"""Parallelism: the device mesh, and how a model is laid out over it (FSDP/HSDP/DDP, tensor, pipeline and expert
parallel, activation checkpointing, compile) and which backend its collectives run on."""
