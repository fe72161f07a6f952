"""A SageMaker model parallel v2 training script, written the way the v2 documentation and the HyperPod test
case write one: `tsm.init` with SMP's parameters, a Hugging Face model, `tsm.transform`, the script's own
FSDP1-style `FullyShardedDataParallel` with a transformer auto-wrap policy on SMP's `TransformerLayer`,
`torch.sagemaker.grad_norm.clip_grad_norm_`, and the v2 checkpoint API.

Nothing in it knows about hpkit. `--plain` runs the same model and global batch on one process with plain
torch (no torch.sagemaker, no FSDP): the reference the tests compare per-step losses against.
Each step, rank 0 prints one JSON line: {"step", "loss", "grad_norm"}; with --layout-out every rank writes
what it holds (parameter shard shapes, experts, the token rows it read) for the tests to check. With
--observe 1, rank 0 also prints {"observed": {"checkpoint_wrappers", "decoder_layers", "offloading"}}: the
activation-checkpoint wrappers in the model, and per forward whether saved-tensor hooks (sm_activation_
offloading's) were active at the LM head, outside every checkpointed layer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model_type", default="llama", choices=["llama", "mixtral", "gpt2"])
    p.add_argument("--max_steps", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--hidden_size", type=int, default=32)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--num_kv_heads", type=int, default=2)
    p.add_argument("--intermediate_size", type=int, default=64)
    p.add_argument("--vocab_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hybrid_shard_degree", type=int, default=0)
    p.add_argument("--tensor_parallel_degree", type=int, default=1)
    p.add_argument("--expert_parallel_degree", type=int, default=1)
    p.add_argument(
        "--smp_config",
        default=None,
        help="a JSON file of SMP parameters instead of the flags; 'estimator': tsm.init() reads the job's own",
    )
    p.add_argument("--activation_checkpointing", type=int, default=0)
    p.add_argument("--delayed_param", type=int, default=0)
    p.add_argument("--fp8", type=int, default=0)
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--checkpoint_freq", type=int, default=0)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--layout_out", default=None)
    p.add_argument("--observe", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="one process, plain torch: the reference")
    return p.parse_args()


def model_config(args: argparse.Namespace):
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=max(64, args.seq),
        tie_word_embeddings=False,
    )
    if args.model_type == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if args.model_type == "gpt2":
        return transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.LlamaConfig(**common)


def create_model(config):
    if isinstance(config, transformers.GPT2Config):
        return transformers.GPT2LMHeadModel(config)
    if isinstance(config, transformers.MixtralConfig):
        return transformers.MixtralForCausalLM(config)
    return transformers.LlamaForCausalLM(config)


def global_batch(step: int, args: argparse.Namespace, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    return torch.randint(0, vocab, (args.global_batch, args.seq), generator=g)


def main() -> None:
    args = parse_args()
    if args.plain:
        run_plain(args)
        return
    import torch.sagemaker as tsm
    import transformer_engine
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.sagemaker import transform
    from torch.sagemaker.delayed_param import DelayedParamIniter
    from torch.sagemaker.grad_norm import clip_grad_norm_
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer
    from transformer_engine.common.recipe import DelayedScaling, Format

    dist.init_process_group("gloo")
    if args.smp_config == "estimator":
        tsm.init()  # as on SageMaker: the parameters the estimator's distribution gave
    elif args.smp_config:
        tsm.init(args.smp_config)
    else:
        smp_config = {"tensor_parallel_degree": args.tensor_parallel_degree}
        if args.hybrid_shard_degree:
            smp_config["hybrid_shard_degree"] = args.hybrid_shard_degree
        if args.expert_parallel_degree > 1:
            smp_config["expert_parallel_degree"] = args.expert_parallel_degree
        tsm.init(smp_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    # As the test case computes it: ranks of one tensor-parallel group read the same batch.
    dp_rank = rank // tsm.state.tp_size
    dp_size = world // tsm.state.tp_size

    transformers.set_seed(args.seed)
    config = model_config(args)
    if args.delayed_param:
        with torch.device("meta"):
            model = create_model(config)
    else:
        model = create_model(config)
    moe_config = None
    if args.model_type == "mixtral":
        from torch.sagemaker.moe.moe_config import MoEConfig

        moe_config = MoEConfig(smp_moe=True, moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.0)
    model = transform(model, config=moe_config)
    delayed_param_initer = DelayedParamIniter(model) if args.delayed_param else None

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    strategy = ShardingStrategy.HYBRID_SHARD if args.hybrid_shard_degree else ShardingStrategy.FULL_SHARD
    model = FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        use_orig_params=True,
        limit_all_gathers=True,
        param_init_fn=delayed_param_initer.get_param_init_fn() if delayed_param_initer else None,
        post_param_init_fn=delayed_param_initer.get_post_param_init_fn() if delayed_param_initer else None,
    )
    if args.activation_checkpointing:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            check_fn=lambda m: isinstance(m, TransformerLayer),
        )
    offloading = observe_offloading(model) if args.observe else []
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    fp8_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16) if args.fp8 else None

    start = 0
    if args.resume_from_checkpoint:
        start = load_checkpoint(model, optimizer, args.resume_from_checkpoint, FSDP)
    local = args.global_batch // dp_size
    if args.layout_out:
        write_layout(args, model, rank, dp_rank, local, tsm)

    for step in range(start, args.max_steps):
        began = time.perf_counter()
        batch = global_batch(step, args, config.vocab_size)[dp_rank * local : (dp_rank + 1) * local]
        optimizer.zero_grad(set_to_none=True)
        if args.fp8:
            with transformer_engine.pytorch.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                loss = model(input_ids=batch, labels=batch)["loss"]
        else:
            loss = model(input_ids=batch, labels=batch)["loss"]
        loss.backward()
        grad_norm = clip_grad_norm_(model, args.grad_clip)
        optimizer.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        if rank == 0:
            record = {"step": step, "loss": reduced.item() / world, "grad_norm": float(grad_norm)}
            print(json.dumps({**record, "time": time.perf_counter() - began}), flush=True)
        if args.checkpoint_dir and args.checkpoint_freq and (step + 1) % args.checkpoint_freq == 0:
            save_checkpoint(model, optimizer, step + 1, args.checkpoint_dir, FSDP)
    if args.observe and rank == 0:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        observed = {
            "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
            "decoder_layers": config.num_hidden_layers,
            "offloading": offloading,
        }
        print(json.dumps({"observed": observed}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def observe_offloading(model) -> list[bool]:
    """Per forward, whether saved-tensor hooks were active when the LM head (never checkpointed) ran."""
    seen: list[bool] = []
    head = next(m for name, m in model.named_modules() if name.endswith("lm_head"))

    def hook(_module, _inputs, _output) -> None:
        seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)

    head.register_forward_hook(hook)
    return seen


def save_checkpoint(model, optimizer, total_steps: int, root: str, FSDP) -> None:
    import torch.sagemaker.distributed.checkpoint.state_dict_saver as saver
    from torch.sagemaker.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type

    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "total_steps": total_steps,
        }
        saver.async_save(state_dict, checkpoint_id=os.path.join(root, f"llama-{total_steps}steps"))
    saver.maybe_finalize_async_calls(blocking=True)


def load_checkpoint(model, optimizer, path: str, FSDP) -> int:
    import torch.sagemaker.distributed.checkpoint.state_dict_loader as loader
    from torch.sagemaker.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type

    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "total_steps": 0,
        }
        loader.load(state_dict, checkpoint_id=path)
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state_dict["optimizer"]))
    return int(state_dict["total_steps"])


def write_layout(args, model, rank: int, dp_rank: int, local: int, tsm) -> None:
    shapes = {}
    for name, p in model.named_parameters():
        local_tensor = p.to_local() if hasattr(p, "to_local") else p
        shapes[name] = list(local_tensor.shape)
    experts = {}
    for name, m in model.named_modules():
        if hasattr(m, "gate_up_proj") and hasattr(m.gate_up_proj, "to_local"):
            held = m.gate_up_proj.to_local()
            # Each held expert's weight sum identifies it against the one-process model's experts.
            experts[name] = {
                "sums": held.sum(dim=(1, 2)).tolist(),
                "placements": [str(p) for p in m.gate_up_proj.placements],
            }
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        weight = model.model.layers[0].self_attn.q_proj.weight
        summoned = list((weight.to_local() if hasattr(weight, "to_local") else weight).shape)
    out = {
        "summoned": summoned,
        "rank": rank,
        "dp_rank": dp_rank,
        "rows": [dp_rank * local, (dp_rank + 1) * local],
        "tp_rank": tsm.state.tp_rank,
        "ep_rank": tsm.state.ep_rank,
        "rep_rank": tsm.state.ranker.get_rep_rank(rank),
        "shapes": shapes,
        "experts": experts,
        "fsdp_units": sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP")),
    }
    Path(args.layout_out).mkdir(parents=True, exist_ok=True)
    Path(args.layout_out, f"rank{rank}.json").write_text(json.dumps(out))


def run_plain(args: argparse.Namespace) -> None:
    transformers.set_seed(args.seed)
    config = model_config(args)
    model = create_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if args.layout_out:
        experts = {
            name: {"sums": m.gate_up_proj.detach().sum(dim=(1, 2)).tolist()}
            for name, m in model.named_modules()
            if hasattr(m, "gate_up_proj")
        }
        Path(args.layout_out).mkdir(parents=True, exist_ok=True)
        Path(args.layout_out, "plain.json").write_text(json.dumps({"experts": experts}))
    for step in range(args.max_steps):
        batch = global_batch(step, args, config.vocab_size)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch)["loss"]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        print(json.dumps({"step": step, "loss": loss.item(), "grad_norm": float(grad_norm)}), flush=True)


if __name__ == "__main__":
    main()
