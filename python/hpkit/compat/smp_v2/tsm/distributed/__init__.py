"""`torch.sagemaker.distributed`."""
