"""Training metrics: throughput, TFLOP/s, MFU and memory, to the console (rank 0), JSONL and TensorBoard.

MFU is reported only where the device's dense peak is known: a wrong peak would make the number
look meaningful when it is not, so an unknown device (any CPU) reports none.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpkit.catalog import peak_tflops_for
from hpkit.metrics.records import EvalEvent, Event, StepRecord


def peak_tflops(device_name: str, device_type: str, mixed_precision: str) -> float | None:
    if device_type != "cuda":
        return None
    return peak_tflops_for(device_name, mixed_precision)


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "max_allocated"
    # ru_maxrss is KiB on Linux: the process's peak resident memory, the closest CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "max_rss"


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens: int  # global tokens in this step
    world_size: int
    flops_per_token: float
    peak_tflops: float | None
    memory_gib: float
    memory_kind: str
    aux_loss: float | None = None  # MoE runs only
    expert_load: float | None = None
    eval_loss: float | None = None  # steps that validated (eval.every): on the step line
    eval_perplexity: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def tflops_per_device(self) -> float:
        return self.flops_per_token * self.tokens_per_s / self.world_size / 1e12

    @property
    def mfu(self) -> float | None:
        return self.tflops_per_device / self.peak_tflops if self.peak_tflops else None

    def record(self) -> StepRecord:
        return StepRecord(
            step=self.step,
            loss=self.loss,
            grad_norm=self.grad_norm,
            lr=self.lr,
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            tflops_per_device=self.tflops_per_device,
            mfu=self.mfu,
            memory_gib=self.memory_gib,
            memory_kind=self.memory_kind,
            aux_loss=self.aux_loss,
            expert_load=self.expert_load,
        )

    def line(self) -> str:
        mfu = f"{self.mfu * 100:.1f}%" if self.mfu is not None else "n/a"
        moe = ""
        if self.aux_loss is not None and self.expert_load is not None:
            moe = f" | aux {self.aux_loss:.4f} | expert load {self.expert_load:.2f}"
        if self.eval_loss is not None and self.eval_perplexity is not None:
            moe += f" | eval loss {self.eval_loss:.4f} | eval ppl {self.eval_perplexity:.2f}"
        return (
            f"step {self.step:>5} | loss {self.loss:.4f} | grad_norm {self.grad_norm:.3f} | lr {self.lr:.2e} | "
            f"{self.tokens_per_s:,.0f} tok/s | {self.tflops_per_device:.2f} TFLOP/s/dev | MFU {mfu} | "
            f"mem {self.memory_gib:.2f} GiB | {self.step_time_s * 1000:.0f} ms{moe}"
        )


@dataclass
class MetricsLogger:
    """Writes on rank 0 only: every rank has the same reduced loss and norm."""

    enabled: bool
    jsonl_path: Path | None
    tensorboard_dir: Path | None
    stream: Any = field(default=sys.stdout)
    _file: Any = None
    _tb: Any = None

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.jsonl_path.open("a", encoding="utf-8")
        if self.tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._tb = None  # TensorBoard is optional: JSONL carries the same numbers
            else:
                self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def log(self, stats: StepStats) -> None:
        if not self.enabled:
            return
        print(stats.line(), file=self.stream, flush=True)
        record = stats.record()
        if self._file is not None:
            # The wall-clock time tells readers (`hpkit status --json`: updated) how fresh the numbers are.
            stamped = dataclasses.replace(record, time=round(time.time(), 3))
            self._file.write(json.dumps(stamped.to_json()) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in record.scalars().items():
                if value is not None:
                    self._tb.add_scalar(key, value, stats.step)

    def evaluation(self, event: EvalEvent) -> None:
        """A validation: its record in the JSONL, and eval_loss / eval_perplexity in TensorBoard."""
        self.event(event)
        if self.enabled and self._tb is not None:
            self._tb.add_scalar("eval_loss", event.loss, event.step)
            self._tb.add_scalar("eval_perplexity", event.perplexity, event.step)

    def event(self, event: Event) -> None:
        """A record of something that happened (hpkit.metrics.records: start, checkpoint, end, ...)."""
        if self.enabled and self._file is not None:
            self._file.write(json.dumps(event.to_json(round(time.time(), 3))) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
