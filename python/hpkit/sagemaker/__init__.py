"""Bringing SageMaker training jobs to Slurm: estimator descriptions → hpkit job specs, and SMDDP's backend choice."""
