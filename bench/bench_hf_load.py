"""Loading weights from Hugging Face safetensors (model.init_from) vs the same weights from a DCP checkpoint.

Both load the model only, into the same FSDP-sharded model, each rank reading just its shards: the HF side
through safetensors slices (plus the q/k row permutation), the DCP side through dcp.load of the model state.
The files are written once (a DCP save by the runtime's Checkpointer, then `hpkit ckpt export --hf` of it),
and the two loads alternate over several rounds so that a noisy machine slows both alike; the page cache is
warm for both after the first round. Each round checks that both loads produced the same weights.

    torchrun --nproc-per-node 2 bench/bench_hf_load.py [--dim 512 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpkit-bench-hf"))
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def main() -> int:
    args = _parse()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hpkit.hf_export import export_hf
    from hpkit.runtime.checkpoints.checkpoint import Checkpointer, ModelState
    from hpkit.runtime.config import CheckpointSpec, RunConfig
    from hpkit.runtime.env import distributed
    from hpkit.runtime.loop.trainer import Trainer
    from hpkit.validation import parse_document

    root = Path(args.dir)
    model = {"name": "debug", "dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4}
    model |= {"ffn_dim": args.dim * 3, "vocab_size": args.vocab, "seq_len": 64}
    base = {"name": "bench-hf", "output_dir": str(root / "logs"), "parallelism": {"dp_shard": -1}}
    base["train"] = {"mixed_precision": "fp32", "tensorboard": False}
    with distributed() as job:
        rank0 = job.launch.rank == 0
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
        # The weights: a random model saved by the runtime, then exported as a Hugging Face directory.
        source = Trainer(parse_document(RunConfig, {**base, "model": model}), job.device)
        ckpt = Checkpointer(CheckpointSpec(), root / "ckpt", job.launch.rank, model=source.model_record())
        ckpt.save(1, source.checkpoint_state(), forced=True)
        ckpt.close()
        step_dir = root / "ckpt" / "step-00000001"
        if rank0:
            export_hf(step_dir, root / "hf")
        dist.barrier()
        source.close()

        trainer = Trainer(
            parse_document(RunConfig, {**base, "model": {"init_from": str(root / "hf"), "seq_len": 64}}),
            job.device,
        )
        state = {"model": ModelState(trainer.model_parts)}
        hf_times, dcp_times = [], []

        def timed(load) -> float:
            dist.barrier()
            start = time.perf_counter()
            load()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank is what training waits for
            return float(took)

        def weights() -> list:
            return [p.to_local().clone() for part in trainer.model_parts for p in part.parameters()]

        for _ in range(args.rounds):
            hf_times.append(timed(trainer.load_pretrained))
            from_hf = weights()
            dcp_times.append(
                timed(
                    lambda: dcp.load(
                        state, storage_reader=dcp.FileSystemReader(step_dir), process_group=ckpt.group
                    )
                )
            )
            same = all(torch.equal(a, b) for a, b in zip(from_hf, weights(), strict=True))
            assert same, "the HF and DCP loads gave different weights"
        trainer.close()
        if rank0:
            params = trainer.model_cfg.num_params()
            hf_bytes = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors"))
            hf_med, dcp_med = statistics.median(hf_times), statistics.median(dcp_times)
            print(
                f"hf_load: {params / 1e6:.1f}M params, {hf_bytes / 2**20:.0f} MiB of safetensors, "
                f"{job.launch.world_size} ranks (FSDP), {args.rounds} rounds, warm page cache"
            )
            print(
                f"TIME hf_load_safetensors_s = {hf_med:.3f} (all: {', '.join(f'{t:.3f}' for t in hf_times)})"
            )
            print(f"TIME hf_load_dcp_s = {dcp_med:.3f} (all: {', '.join(f'{t:.3f}' for t in dcp_times)})")
            print(f"RATIO hf_load_vs_dcp = {hf_med / dcp_med:.3f} (time from safetensors / time from DCP)")
        dist.barrier()
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
