"""Hugging Face Llama checkpoints in (`model.init_from`) and out (`hpkit ckpt export --hf`): the `hf` extra."""
