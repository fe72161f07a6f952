"""`torch.sagemaker.distributed.checkpoint`: save and load on torch DCP, with hpkit's commit record."""
