"""hpkit: distributed PyTorch training on Slurm and SageMaker HyperPod clusters."""

__version__ = "0.1.0"
