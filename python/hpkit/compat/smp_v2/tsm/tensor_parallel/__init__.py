"""`torch.sagemaker.tensor_parallel`."""
