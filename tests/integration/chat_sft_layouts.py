"""One training step on prepared chat data (packed, masked) from a Hugging Face Llama, in one layout.

Launched by tests/integration/test_chat_sft.py (plain python for one process, torchrun for more). Rank 0 saves
the step's loss as the runtime reports it and the raw rows (token ids and flags) every data-parallel rank
trained on, so the test can recompute the loss with transformers, conversation by conversation.
Usage: chat_sft_layouts.py HF_DIR DATA_DIR OUT.pt PARALLELISM_JSON LOCAL_BATCH SEQ
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist

from hpkit.runtime.config import RunConfig
from hpkit.runtime.env import distributed
from hpkit.runtime.loop.trainer import Trainer
from hpkit.validation import parse_document


def main() -> None:
    hf_dir, data_dir, out = sys.argv[1:4]
    parallelism, local_batch, seq = json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    with distributed() as d:
        cfg = parse_document(
            RunConfig,
            {
                "name": "chat-sft",
                "output_dir": tempfile.mkdtemp(),
                "parallelism": parallelism,
                "model": {"init_from": hf_dir, "seq_len": seq},
                "train": {
                    "steps": 1,
                    "local_batch_size": local_batch,
                    "mixed_precision": "fp32",
                    "tensorboard": False,
                    "seed": 5,
                    "data": {"kind": "prepared", "path": data_dir},
                },
            },
        )
        trainer = Trainer(cfg, d.device)
        trainer.load_pretrained()
        loader = trainer.loader
        first = loader.position + loader.dp_rank * loader.local_batch
        rows = [loader.source.row(first + j) for j in range(loader.local_batch)]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (trainer.coords.dp_rank, rows))
        loss = trainer.train_step().loss
        trainer.close()
        if dist.get_rank() == 0:
            by_dp = dict(gathered)
            torch.save({"loss": loss, "rows": [r for dp in sorted(by_dp) for r in by_dp[dp]]}, out)


if __name__ == "__main__":
    main()
