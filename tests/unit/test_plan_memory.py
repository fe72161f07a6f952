"""The planner's shapes, layouts and memory formulas: hand-computed small cases, the runtime's own numbers, and
the directions memory must move (more checkpointing, more shards: less per rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from hpkit.errors import SpecError
from hpkit.plan.layout import Layout
from hpkit.plan.memory import in_flight, predict
from hpkit.plan.shapes import ModelShape, resolve_model, shape_named, shape_of_spec
from hpkit.runtime.config import ModelSpec, RunConfig
from hpkit.validation import parse_document

TINY = ModelShape(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=32, seq_len=4)


def test_params_of_a_tiny_shape_by_hand():
    # Per block: attention 8*4*(2*2 + 1*2) = 192, SwiGLU 3*8*16 = 384, two norms 16: 592. Two blocks,
    # final norm 8, embeddings and head 2*32*8 = 512.
    assert TINY.params() == 2 * 592 + 8 + 512


def test_a_shapes_parameter_count_is_the_built_models():
    """The one count (ModelShape.params, which LlamaConfig.num_params calls) against the tensors the runtime
    builds: dense, grouped-query, an explicit head size, and MoE with shared experts and dense blocks."""
    from hpkit.models.llama.model import build_model, config_of_shape

    moe = {"experts": 4, "top_k": 2, "shared_experts": 1, "every": 2, "expert_ffn_dim": 48}
    for shape in (
        TINY,
        shape_named("debug", 64, n_heads=8, n_kv_heads=2),
        replace(shape_named("debug", 64), head_dim=8),
        shape_named("debug", 64, n_layers=4, moe=moe),
        shape_named("debug-moe", 64),
    ):
        model = build_model(config_of_shape(shape), "meta")
        assert sum(p.numel() for p in model.parameters()) == shape.params(), shape


def test_a_spec_model_block_is_the_shape_the_adapter_builds():
    from hpkit.models.adapters import adapter_for

    for block in (
        {"name": "debug", "dim": 64, "n_heads": 4},
        {"name": "debug", "moe": {"experts": 4}},
        {"name": "debug-moe", "moe": {"top_k": 2}, "n_layers": 4},
    ):
        spec = ModelSpec(**block)
        cfg = adapter_for("moe" if spec.moe or spec.name == "debug-moe" else "llama").config(
            spec.named_shape()
        )
        assert cfg.shape == replace(shape_of_spec(spec), seq_len=cfg.max_seq_len, name="custom"), block


MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def test_a_hf_folder_plans_the_shape_the_runtime_loads_and_refuses_what_it_refuses(tmp_path):
    from hpkit.models.llama.hf_format import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    shape = resolve_model(tmp_path, 256)
    assert (shape.experts, shape.top_k, shape.shared_experts, shape.every) == (4, 2, 0, 1)
    assert read_hf_config(tmp_path, 256).cfg.shape == replace(shape, name="custom")
    # What the runtime cannot load is not planned either, in the runtime's words.
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL, "attention_bias": True}))
    with pytest.raises(SpecError) as err:
        resolve_model(tmp_path, 256)
    assert (
        str(err.value) == f"{tmp_path}/config.json: attention_bias: true: the runtime's Llama has no biases"
    )


def test_an_unsupported_family_is_one_line_naming_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL, "model_type": "gpt2"}))
    with pytest.raises(SpecError, match=r"config.json: model_type: 'gpt2': only Llama and Mixtral") as err:
        resolve_model(tmp_path, 256)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="neither a shape name"):
        resolve_model("9B", 256)


def test_layout_round_trips_through_the_spec_blocks():
    cfg = parse_document(
        RunConfig,
        {
            "parallelism": {"dp_shard": -1, "tp": 2, "pp": 2, "microbatches": 4, "pp_schedule": "gpipe"},
            "train": {"local_batch_size": 8, "activation_checkpoint": "full"},
        },
    )
    layout = Layout.from_run_config(cfg, world=16)
    assert (layout.dp_shard, layout.tp, layout.pp, layout.world) == (4, 2, 2, 16)
    assert layout.precision == "bf16"  # auto, on GPUs
    assert Layout.from_run_config(cfg, world=16, device_type="cpu").precision == "fp32"
    again = parse_document(
        RunConfig, {"parallelism": layout.parallelism_fields(), "train": layout.train_fields()}
    )
    assert Layout.from_run_config(again) == layout


def test_a_layout_the_runtime_refuses_gets_the_validators_message():
    with pytest.raises(SpecError, match="microbatches=2 must be >= pp=4"):
        Layout(pp=4, microbatches=2).to_parallelism()
    with pytest.raises(SpecError, match="inferred from the world size"):
        Layout.from_run_config(parse_document(RunConfig, {"parallelism": {"dp_shard": -1}}))


def test_microbatches_in_flight_per_schedule():
    gpipe = Layout(pp=4, microbatches=8, pp_schedule="gpipe")
    assert [in_flight(gpipe, r) for r in range(4)] == [[8]] * 4
    one_f_one_b = replace(gpipe, pp_schedule="1f1b")
    assert [in_flight(one_f_one_b, r) for r in range(4)] == [[4], [3], [2], [1]]
    zbv = replace(gpipe, pp_schedule="zero_bubble", stages_per_rank=2)
    # Rank r: 2(pp-r)-1 + r chunk-0 forwards, r + 1 chunk-1 forwards before a chunk's first backward.
    assert [sum(in_flight(zbv, r)) for r in range(4)] == [8, 8, 8, 8]


FSDP = Layout(dp_shard=4, local_batch_size=2, precision="fp32")


def test_sharded_weights_by_hand():
    # fp32 master weights: 4 bytes per local element; AdamW 8 more, plus a 4-byte step per tensor.
    single = predict(TINY, replace(FSDP, dp_shard=1)).worst.breakdown
    assert single.params == 4 * TINY.params()
    tensors = 1 + 2 * 9 + 2
    assert single.optimizer == 8 * TINY.params() + 4 * tensors
    sharded = predict(TINY, FSDP).worst.breakdown
    # Every weight's first dimension divides by 4 except the norms' (8) ... all do here: a quarter each.
    assert sharded.params == single.params // 4


def test_more_checkpointing_saves_activations():
    shape = shape_named("1B", 2048)
    by_ac = [
        predict(shape, replace(FSDP, dp_shard=8, activation_checkpoint=ac)).worst.breakdown.activations
        for ac in ("none", "selective", "full")
    ]
    assert by_ac[0] > by_ac[1] > by_ac[2] > 0


def test_more_shards_less_per_rank():
    shape = shape_named("8B", 4096)
    base = Layout(dp_shard=2, local_batch_size=1, activation_checkpoint="full")
    peaks = [predict(shape, replace(base, dp_shard=n), "p5.48xlarge").peak_bytes for n in (2, 8, 64)]
    assert peaks[0] > peaks[1] > peaks[2]
    tp = [predict(shape, replace(base, tp=t), "p5.48xlarge").peak_bytes for t in (1, 2, 8)]
    assert tp[0] > tp[1] > tp[2]


def test_the_last_stage_holds_the_logits_and_the_first_stage_the_most_microbatches():
    shape = shape_named("debug", 256)
    plan = predict(shape, Layout(pp=2, microbatches=4, local_batch_size=4, precision="fp32"))
    first, last = (r.breakdown for r in plan.ranks)
    assert first.logits_loss == 0 < last.logits_loss
    assert first.activations == 2 * last.activations  # 1F1B: 2 microbatches in flight against 1
    assert plan.ranks[1].kind == "pp rank 1 (stage 1)"


def test_gpu_fixed_costs_only_on_gpus():
    shape = shape_named("debug", 256)
    assert predict(shape, FSDP).worst.breakdown.fixed == 0
    assert predict(shape, FSDP, "ml.p5.48xlarge").worst.breakdown.fixed > 2**30


def test_planning_a_70b_imports_no_torch():
    # How long 16 predictions take is bench/bench_plan_ranking.py's to say, not a unit test's.
    code = (
        "import sys\n"
        "from hpkit.plan import Layout, predict, shape_named\n"
        "s = shape_named('70B', 8192)\n"
        "for tp in (1, 2, 4, 8):\n"
        "    for pp in (1, 2, 4, 8):\n"
        "        predict(s, Layout(dp_shard=128 // tp // pp, tp=tp, pp=pp, microbatches=8, local_batch_size=8), 'p5.48xlarge')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_one_process_without_fsdp_holds_no_fsdp_unsharded_weights():
    # One GPU, bf16 by autocast, no FSDP: the matmuls' saved bf16 weight copies are autocast's (every weight but
    # the embeddings), not FSDP's.
    shape = shape_named("1B", 2048)
    worst = predict(shape, Layout(local_batch_size=2), "p5.48xlarge").worst.breakdown
    assert worst.fsdp_unsharded == 0
    assert worst.autocast_copies == 2 * (shape.params() - shape.vocab_size * shape.dim)
    fsdp = predict(shape, Layout(dp_shard=8, local_batch_size=2), "p5.48xlarge").worst.breakdown
    assert fsdp.fsdp_unsharded > 0 and fsdp.autocast_copies == 0


def test_the_loss_holds_its_logits_upcast_log_softmax_and_two_gradients_by_hand():
    # 1B's vocabulary dwarfs the rest of the head: bf16 logits (2 bytes a logit, kept by hpkit's trainer through
    # backward), log-softmax's fp32 output (4) and, in backward, nll's and log-softmax's fp32 gradients (4 + 4).
    from hpkit.plan.kernels import TORCHTITAN

    shape = shape_named("1B", 2048)
    tokens, v = 2 * 2048, shape.vocab_size
    norm = tokens * 3 * 4 * shape.dim  # the final norm's saves, fp32 stream under autocast
    gpu = predict(shape, Layout(local_batch_size=2), "p5.48xlarge").worst.breakdown
    assert gpu.logits_loss == norm + tokens * v * (2 + 4 + 4 + 4)
    # A loop that drops its logits before backward (torchtitan) holds 12 bytes a logit, and the allocator keeps
    # the freed bf16 block reserved: too small for a 4-byte gradient.
    fsdp = Layout(dp_shard=8, local_batch_size=2)
    tt = predict(shape, fsdp, "p5.48xlarge", TORCHTITAN).worst.breakdown
    hp = predict(shape, fsdp, "p5.48xlarge").worst.breakdown
    assert hp.logits_loss - tt.logits_loss == tokens * v * 2
    assert tt.reserve - hp.reserve >= tokens * v * 2
    # CPU ranks, fp32 (as measured there): logits and log-softmax (4 + 4), backward's two gradients (8).
    cpu = predict(shape, Layout(local_batch_size=2, precision="fp32")).worst.breakdown
    assert cpu.logits_loss == tokens * (v * 8 + 3 * 4 * shape.dim) + tokens * v * 8


def test_gpu_attention_keeps_no_probabilities_and_each_selective_policy_its_own_tensors():
    from hpkit.plan.kernels import TORCHTITAN

    shape = shape_named("8B", 8192)
    layout = Layout(dp_shard=8, local_batch_size=2, activation_checkpoint="none")
    gpu = predict(shape, layout, "p5.48xlarge").worst.breakdown.activations
    # Per token per block under FSDP bf16 (h 4096, q 4096, kv 1024, f 14336, 32 heads): the residual stream
    # and norm outputs 4 x 2h, two rstd 8, rotary's q, k, v and the output 2(2q + 2kv), the log-sum-exp 4 x 32,
    # SwiGLU 4 x 2f: no seq x seq term.
    per_token = 8 * 4096 + 8 + 2 * (2 * 4096 + 2 * 1024) + 4 * 32 + 8 * 14336
    assert gpu == per_token * 2 * 8192 * 32
    sac = replace(layout, activation_checkpoint="selective")
    hpkit = predict(shape, sac, "p5.48xlarge").worst.breakdown.activations
    titan = predict(shape, sac, "p5.48xlarge", TORCHTITAN).worst.breakdown.activations
    # torchtitan's op SAC recomputes wk, wo and w3 (every second mm): 2(kv + h + f) bytes a token a block less.
    saved_less = 2 * (1024 + 4096 + 14336) * 2 * 8192 * 32
    # hpkit's trainer also still holds the bf16 logits while the last block is recomputed.
    logits = 2 * 2 * 8192 * shape.vocab_size
    assert hpkit - titan == saved_less + logits


def test_the_torch_check_refuses_what_its_tracker_cannot_follow_in_one_line():
    from hpkit.plan.torch_check import check_with_torch

    with pytest.raises(SpecError, match="--check-with-torch follows FSDP-only layouts") as err:
        check_with_torch(TINY, Layout(dp_shard=2, tp=2))
    assert "\n" not in str(err.value)


def test_lora_trains_only_the_adapters_by_hand():
    spec = ModelSpec(name="debug", lora={"rank": 2})
    assert shape_of_spec(spec).lora_targets == tuple(spec.lora.targets)
    lora = replace(TINY, lora_rank=2, lora_targets=tuple(spec.lora.targets))
    # Per block, A (2 x in) + B (out x 2) of q 8x8, k 8x4, v 8x4, o 8x8, gate 8x16, up 8x16, down 16x8:
    # 32 + 24 + 24 + 32 + 48 + 48 + 48 = 256; two blocks, 14 adapter tensors each.
    whole = predict(lora, replace(FSDP, dp_shard=1)).worst.breakdown
    assert whole.optimizer == 8 * 512 + 4 * 28
    assert whole.params == 4 * TINY.params() + 4 * 512  # fp32: the frozen base stays fp32
    bf16 = predict(lora, replace(FSDP, dp_shard=1, precision="bf16")).worst.breakdown
    projections = 2 * (592 - 16) + 32 * 8  # every nn.Linear: blocks' projections and the head
    assert bf16.params == whole.params - 2 * projections


def test_fsdps_sharded_gradients_count_once_when_the_optimizer_step_is_the_peak():
    # Short sequences, full checkpointing: the optimizer step (every gradient, no activation) is the peak. The
    # sharded gradients live in the reduce-scatter stream's pool: the reserve holds them only at the other peak.
    shape = shape_named("8B", 512)
    layout = Layout(dp_shard=2, local_batch_size=1, activation_checkpoint="full")
    worst = predict(shape, layout, "p5.48xlarge").worst.breakdown
    assert worst.activations == 0 and worst.grads == worst.params  # fp32 shards of each
    assert worst.reserve < worst.grads
