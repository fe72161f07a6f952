"""SageMaker's distributed-training APIs on hpkit's runtime, opt-in per job through a shim on PYTHONPATH."""
