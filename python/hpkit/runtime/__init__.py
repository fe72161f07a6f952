"""What runs inside the job: environment, parallelisms, data, checkpoints, metrics and the loop."""
