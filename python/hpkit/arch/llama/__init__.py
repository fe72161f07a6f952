"""The Llama family and its mixture-of-experts variant as plain numbers: the named shapes (named), a shape's
counts and rules (shape), and Hugging Face's config.json read into one (hf).

The torch modules that run these shapes are hpkit.models.llama and hpkit.models.moe; the runtime's adapters
(hpkit.runtime.adapters.llama, .moe) build, split and shard them.
"""
