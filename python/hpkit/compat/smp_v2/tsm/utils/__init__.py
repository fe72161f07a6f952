"""`torch.sagemaker.utils`."""
