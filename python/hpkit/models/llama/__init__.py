"""The Llama family and its mixture-of-experts variant (the `llama` and `moe` families), in one folder.

Torch-free (the planner reads them on login nodes): the named shapes (named), a shape's counts and rules
(shape), and Hugging Face's config.json read into one (config_json).
With torch: the decoder (model), its mixture-of-experts FFN (moe), the Hugging Face tensor names and config
both ways (hf_format), and the adapters the runtime builds, splits and shards them through (adapter for
`llama`, moe_adapter for `moe`).
"""
