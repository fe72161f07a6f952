"""`torch.sagemaker.distributed.fsdp`."""
