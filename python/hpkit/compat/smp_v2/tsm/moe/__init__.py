"""`torch.sagemaker.moe`."""
