"""hpkit.plan.kernels: the attention kernel SDPA picks on a GPU, and the selective policies' saves against the
runtime's own list."""

from __future__ import annotations

from hpkit.plan.kernels import HPKIT_SELECTIVE, MATMULS, TORCHTITAN_OP_SELECTIVE, sdpa_kernel


def test_sdpa_picks_flash_for_half_precision_and_falls_back_by_dtype_mask_and_gqa() -> None:
    assert sdpa_kernel("cuda", "bf16", 128) == "flash"
    assert sdpa_kernel("cuda", "bf16", 128, gqa=True) == "flash"  # flash takes enable_gqa natively
    assert sdpa_kernel("cuda", "bf16", 512) == "efficient"  # past flash's head dim
    assert sdpa_kernel("cuda", "fp32", 128) == "efficient"  # flash is fp16/bf16 only
    assert sdpa_kernel("cuda", "fp32", 128, gqa=True) == "math"  # efficient takes no enable_gqa
    assert sdpa_kernel("cuda", "bf16", 128, masked=True, gqa=True) == "math"  # packed documents' mask
    assert sdpa_kernel("cpu", "bf16", 128) == "cpu_flash"


def test_hpkits_selective_policy_keeps_what_the_runtime_saves() -> None:
    import torch

    from hpkit.runtime.parallel.activation_checkpoint import _SAVE_OPS

    # Every matmul of a block is an mm once F.linear flattens its input, and the GPU attention kernels are saved.
    assert torch.ops.aten.mm.default in _SAVE_OPS
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in _SAVE_OPS
    assert torch.ops.aten._scaled_dot_product_efficient_attention.default in _SAVE_OPS
    assert HPKIT_SELECTIVE.kept_matmuls == MATMULS and HPKIT_SELECTIVE.keeps_attention
    # torchtitan's op SAC: mm 1, 3, 5, 7 of wq, wk, wv, wo, w1, w3, w2.
    assert TORCHTITAN_OP_SELECTIVE.kept_matmuls == MATMULS[0::2]


def test_a_v100_has_no_flash_kernel_and_keeps_what_the_efficient_one_keeps() -> None:
    from hpkit.models.llama.shape import shape_named
    from hpkit.plan.layout import Layout
    from hpkit.plan.memory import predict

    assert sdpa_kernel("cuda", "bf16", 128, gpu="V100") == "efficient"
    shape = shape_named("1B", 2048)
    layout = Layout(dp_shard=8, local_batch_size=1)
    # Without GQA (efficient takes no enable_gqa, so 1B's GQA would fall to math): the same saves as flash.
    mha = shape.__class__(**{**shape.__dict__, "n_kv_heads": shape.n_heads})
    v100 = predict(mha, layout, "p3.16xlarge").worst.breakdown.activations
    h100 = predict(mha, layout, "p5.48xlarge").worst.breakdown.activations
    assert v100 == h100
    # With GQA the V100 runs math and keeps the S x S probabilities.
    assert predict(shape, layout, "p3.16xlarge").worst.breakdown.activations > 2 * v100
