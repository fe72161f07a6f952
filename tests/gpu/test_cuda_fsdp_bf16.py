"""FSDP2 with bf16 mixed precision on CUDA keeps fp32 master weights and reduces gradients in the configured dtype.

Runs hpkit's own `apply_fsdp` on a one-GPU mesh (NCCL, world of one) in a subprocess, and records what the weights,
the gathered parameters seen by forward, and the gradients really are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _gpu import REPO

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from hpkit.models.llama.model import build_model, config_for
    from hpkit.runtime.parallel.fsdp import apply_fsdp, mixed_precision_policy

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
    cfg = config_for("debug", 64, dim=128, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=512)
    model = build_model(cfg, "meta")
    apply_fsdp(model, mesh, "bf16", pp_enabled=False)
    model.to_empty(device="cuda")
    model.init_weights(3)
    seen = set()
    def hook(module, args, output):
        seen.add(str(module.weight.dtype))
    model.layers["0"].attention.wq.register_forward_hook(hook)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    policy = mixed_precision_policy("bf16")
    out = {
        "master": sorted({str(p.dtype) for p in model.parameters()}),
        "forward": sorted(seen),
        "logits": str(logits.dtype),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "reduce": str(policy.reduce_dtype),
        "param": str(policy.param_dtype),
    }
    json.dump(out, open(sys.argv[1], "w"))
    dist.destroy_process_group()
    """
)


def test_fsdp_bf16_keeps_fp32_master_weights_and_reduce_dtype(tmp_path):
    out = tmp_path / "dtypes.json"
    # This checkout first, then whatever the caller had on the path (where the dependencies may live).
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "python"), os.environ.get("PYTHONPATH")) if p),
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-6000:]
    got = json.loads(out.read_text())
    assert got["master"] == ["torch.float32"], f"sharded master weights must stay fp32: {got}"
    assert got["forward"] == ["torch.bfloat16"], f"forward must see bf16 gathered weights: {got}"
    assert got["logits"] == "torch.bfloat16", got
    assert got["grads"] == ["torch.float32"], f"gradients land on the fp32 shards: {got}"
    assert (got["param"], got["reduce"]) == ("torch.bfloat16", "torch.float32"), got
