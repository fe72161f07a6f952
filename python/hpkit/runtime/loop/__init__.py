"""The training step and validation: the Trainer, its data, the loss, gradient norm and clipping, LoRA adapters
and the evaluator."""
