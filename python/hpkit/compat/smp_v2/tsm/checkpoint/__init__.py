"""`torch.sagemaker.checkpoint`."""
