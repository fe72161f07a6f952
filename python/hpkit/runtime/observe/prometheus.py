"""Training metrics for Prometheus, through prometheus-client: a node_exporter textfile, or an HTTP endpoint.

Every rank exports its own series, labelled job_id, rank and node: the loss and throughput are the
job's (the same on every rank), the step time, memory and local work time are the rank's own.

- textfile_dir: one file per rank, `<name>-<job>-rank<r>.prom`, rewritten (temporary file + rename, so
  node_exporter never reads half a file) on each logging step. Per rank rather than per node because
  each rank owns its numbers: a per-node file would need the ranks of a node to meet (a sync the
  training loop must not have) or one writer to gather them. node_exporter merges the files; their
  series differ by the rank label. The file is removed when the run ends, so that a finished job does
  not look alive; one killed outright leaves its file, and `hpkit_train_last_step_timestamp_seconds`
  tells how stale it is.
- port: local rank r serves /metrics on port + r (ranks of one node cannot share a port).

The job's id is the label `job_id`, not `job`: Prometheus sets `job` itself (the scrape job) and would
rename ours to `exported_job`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server, write_to_textfile

from hpkit.errors import SpecError
from hpkit.runtime.config import PrometheusSpec
from hpkit.runtime.observe.metrics import StepStats
from hpkit.runtime.watchdog.stragglers import Window

LABELS = ("job_id", "rank", "node")


class PrometheusExporter:
    def __init__(self, spec: PrometheusSpec, name: str, job_id: str, rank: int, local_rank: int, node: str):
        self.rank = rank
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"job_id": job_id, "rank": str(rank), "node": node}
        g = self._gauge
        self.step = g("hpkit_train_step", "The last step the run finished")
        self.loss = g(
            "hpkit_train_loss", "Training loss at the last logged step (mean over data-parallel ranks)"
        )
        self.grad_norm = g("hpkit_train_grad_norm", "Total gradient norm before clipping")
        # Labelled on first use: a run that has not validated yet has no validation loss (not 0).
        self.eval_loss = Gauge(
            "hpkit_train_eval_loss",
            "Validation loss at the last validation: the mean over every counted token of the held-out set",
            LABELS,
            registry=self.registry,
        )
        self.eval_perplexity = Gauge(
            "hpkit_train_eval_perplexity",
            "exp(validation loss) at the last validation",
            LABELS,
            registry=self.registry,
        )
        self.eval_step = Gauge(
            "hpkit_train_eval_step", "The step of the last validation", LABELS, registry=self.registry
        )
        self.lr = g("hpkit_train_learning_rate", "Learning rate of the last logged step")
        self.tokens_per_s = g("hpkit_train_tokens_per_second", "Tokens per second, the whole job")
        self.step_s = g("hpkit_train_step_seconds", "Wall time of the last logged step on this rank")
        self.flops = g("hpkit_train_device_flops_per_second", "Model FLOP/s per device (6N + attention)")
        # Labelled on first use: a child made up front would read 0 (idle) where the peak is unknown.
        self.mfu = Gauge(
            "hpkit_train_mfu_ratio",
            "Model FLOPs utilisation, 0-1 (only where the device's peak is known)",
            LABELS,
            registry=self.registry,
        )
        self.memory = g("hpkit_train_memory_peak_bytes", "Peak memory of this rank (device, or RSS on CPU)")
        self.stamp = g("hpkit_train_last_step_timestamp_seconds", "Unix time of the last logged step")
        self.work_s = g(
            "hpkit_train_local_work_seconds",
            "Mean per step of the work that waits for no other rank, over the last straggler window",
        )
        self.slowdown = g(
            "hpkit_train_slowdown_ratio", "This rank's local work time over the median of the other ranks'"
        )
        self.stragglers = Counter(
            "hpkit_train_stragglers",
            "Times this rank was found a straggler",
            LABELS,
            registry=self.registry,
        ).labels(**self.labels)
        self.path: Path | None = None
        self._server: Any = None
        if spec.textfile_dir is not None:
            folder = Path(spec.textfile_dir)
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"{name}-{job_id}-rank{rank}.prom"
            self.write()
        else:
            assert spec.port is not None
            port = spec.port + local_rank
            try:
                self._server, _ = start_http_server(port, registry=self.registry)
            except OSError as exc:
                raise SpecError(
                    f"train.prometheus.port: rank {rank} (local rank {local_rank}) cannot listen on port {port} "
                    f"of {node} ({exc.strerror}): choose a port p such that p .. p + ranks per node - 1 are free"
                ) from None

    def _gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(**self.labels)

    def log(self, stats: StepStats) -> None:
        """A logging step: the same numbers as the metrics JSONL (this rank's step time and memory)."""
        self.step.set(stats.step)
        self.loss.set(stats.loss)
        self.grad_norm.set(stats.grad_norm)
        self.lr.set(stats.lr)
        self.tokens_per_s.set(stats.tokens_per_s)
        self.step_s.set(stats.step_time_s)
        self.flops.set(stats.tflops_per_device * 1e12)
        if stats.mfu is not None:
            self.mfu.labels(**self.labels).set(stats.mfu)
        self.memory.set(stats.memory_gib * 2**30)
        self.stamp.set(time.time())
        self.write()

    def evaluation(self, step: int, loss: float, perplexity: float) -> None:
        """A validation (written at once: it is rarer than a logging step, and an eval.only run has none)."""
        self.eval_loss.labels(**self.labels).set(loss)
        self.eval_perplexity.labels(**self.labels).set(perplexity)
        self.eval_step.labels(**self.labels).set(step)
        self.write()

    def window(self, window: Window) -> None:
        """A straggler window's verdict; written with the next logging step."""
        self.work_s.set(window.local_work_s[self.rank])
        self.slowdown.set(window.ratios[self.rank])
        if any(s.rank == self.rank for s in window.stragglers):
            self.stragglers.inc()

    def write(self) -> None:
        if self.path is not None:
            write_to_textfile(str(self.path), self.registry)  # a temporary file, then rename(2)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            self.path = None
