"""Loads a Hugging Face Llama with model.init_from in one parallel layout and records what to compare.

Launched under torchrun by tests/integration/test_hf_weights_dist.py (every layout in one launch: a launch costs
more than a layout) and test_hf_mixtral.py. Rank 0 saves (torch.save) the logits on a fixed batch (every rank
feeds the same one), every data-parallel rank's first-step batch, the first step's loss as the runtime reports
it, and how many bytes each rank read from the safetensors files.
Usage: hf_layouts.py HF_DIR OUT.pt PARALLELISM_JSON, or hf_layouts.py HF_DIR OUT_DIR '{"NAME": PARALLELISM, ...}'
(several layouts one after the other in one process group, each saved as OUT_DIR/NAME.pt).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpkit.runtime.config import RunConfig
from hpkit.runtime.env import Distributed, distributed
from hpkit.runtime.loop.trainer import Trainer
from hpkit.validation import parse_document

SEQ = 32


def main() -> None:
    hf_dir, out, layouts = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    with distributed() as d:
        if "dp_shard" in layouts:  # one layout
            record(d, hf_dir, out, layouts)
            return
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
        for name, parallelism in layouts.items():
            record(d, hf_dir, out / f"{name}.pt", parallelism)


def record(d: Distributed, hf_dir: str, out: Path, parallelism: dict) -> None:
    cfg = parse_document(
        RunConfig,
        {
            "name": "hf-layouts",
            "output_dir": tempfile.mkdtemp(),
            "parallelism": parallelism,
            "model": {"init_from": hf_dir, "seq_len": SEQ},
            "train": {
                "steps": 1,
                "local_batch_size": 2,
                "mixed_precision": "fp32",
                "tensorboard": False,
                "seed": 7,
            },
        },
    )
    trainer = Trainer(cfg, d.device)
    stats = trainer.load_pretrained()
    tokens = torch.randint(
        0, trainer.model_cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1)
    )
    logits = None
    logits_placements = None
    if not trainer.dims.pp_enabled:  # a pipeline stage alone gives no logits; its loss is compared
        with torch.no_grad():
            result = trainer.module(tokens.to(trainer.device))
        if isinstance(result, DTensor):
            # Loss parallel: under tensor parallel the logits stay sharded over the vocabulary.
            logits_placements = [str(p) for p in result.placements]
            result = result.full_tensor()
        logits = result.float().cpu()
    position = trainer.loader.position
    inputs, labels = trainer.loader.next_batch()
    trainer.loader.position = position
    batch = (trainer.coords.dp_rank, inputs, labels)
    batches: list = [None] * dist.get_world_size()
    read: list = [None] * dist.get_world_size()
    dist.all_gather_object(batches, batch)
    dist.all_gather_object(read, stats.bytes_read)
    loss = trainer.train_step().loss
    trainer.close()
    if dist.get_rank() == 0:
        by_dp = {dp: (i, lab) for dp, i, lab in batches}
        torch.save(
            {
                "logits": logits,
                "logits_placements": logits_placements,
                "tokens": tokens,
                "batches": by_dp,
                "loss": loss,
                "bytes_read": read,
            },
            out,
        )


if __name__ == "__main__":
    main()
