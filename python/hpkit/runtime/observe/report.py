"""What a finished step leaves behind: the console line, JSONL and TensorBoard (rank 0), Prometheus (every
rank that exports), and the straggler verdicts (a warning and a JSONL record on rank 0)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpkit.metrics.records import EvalEvent, StepTimesEvent, StragglerEvent
from hpkit.runtime.loop.evaluate import EvalResult
from hpkit.runtime.loop.trainer import StepResult, Trainer
from hpkit.runtime.observe.metrics import MetricsLogger, StepStats, peak_memory_gib
from hpkit.runtime.watchdog.stragglers import Window

if TYPE_CHECKING:  # prometheus-client is imported only by jobs that export (run._exporter)
    from hpkit.runtime.observe.prometheus import PrometheusExporter


@dataclass
class StepReporter:
    trainer: Trainer
    metrics: MetricsLogger
    exporter: PrometheusExporter | None
    peak_tflops: float | None
    say: Callable[[str], None]  # prints on rank 0 only

    def step(self, result: StepResult, evaluation: EvalResult | None = None) -> None:
        if result.logged:
            stats = self.stats(result)
            if evaluation is not None:
                stats.eval_loss, stats.eval_perplexity = evaluation.loss, evaluation.perplexity
            self.metrics.log(stats)
            if self.exporter is not None:
                self.exporter.log(stats)
        elif evaluation is not None:  # a validation on a step between logging steps: a line of its own
            self.say(f"step {result.step:>5} | {evaluation.line()}")
        if evaluation is not None:
            self.evaluation(evaluation)
        if result.window is not None:
            self.window(result.window)

    def evaluation(self, result: EvalResult, only: bool = False) -> None:
        """A validation's record (JSONL, TensorBoard) and gauges; the console line is the caller's."""
        self.metrics.evaluation(
            EvalEvent(
                result.step,
                loss=result.loss,
                perplexity=result.perplexity,
                tokens=result.tokens,
                batches=result.batches,
                seconds=round(result.seconds, 4),
                only=only,
            )
        )
        if self.exporter is not None:
            self.exporter.evaluation(result.step, result.loss, result.perplexity)

    def window(self, window: Window) -> None:
        if self.exporter is not None:
            self.exporter.window(window)
        self.metrics.event(StepTimesEvent(window.step, window.steps, window.local_work_s, window.step_s))
        nodes = self.trainer.stragglers.nodes if self.trainer.stragglers is not None else []
        spec = self.trainer.cfg.train.stragglers
        for s in window.stragglers:
            node = nodes[s.rank] if s.rank < len(nodes) else "?"
            self.say(
                f"hpkit train: WARNING: straggler: rank {s.rank} on node {node} is {s.factor:.1f}x slower than "
                f"the other ranks' median ({s.seconds * 1000:.1f} ms vs {s.median_s * 1000:.1f} ms of local "
                f"work per step) for {spec.windows} windows of {spec.every_steps} steps, up to step {window.step}"
            )
            self.metrics.event(
                StragglerEvent(
                    window.step,
                    rank=s.rank,
                    node=node,
                    factor=s.factor,
                    local_work_s=s.seconds,
                    median_local_work_s=s.median_s,
                    windows=spec.windows,
                )
            )
        links = self.trainer.stragglers.links if self.trainer.stragglers is not None else None
        for s in window.slow_links:
            node = links.nodes[s.rank] if links is not None and s.rank < len(links.nodes) else "?"
            self.say(
                f"hpkit train: WARNING: straggler: node {node}'s links are {s.factor:.1f}x slower than the other "
                f"nodes' median ({s.seconds * 1000:.1f} ms vs {s.median_s * 1000:.1f} ms for a "
                f"{spec.link_probe_bytes}-byte probe, its faster link) for {spec.windows} windows of "
                f"{spec.every_steps} steps, up to step {window.step}"
            )

    def stats(self, result: StepResult) -> StepStats:
        t = self.trainer
        mem, kind = peak_memory_gib(t.device)
        return StepStats(
            result.step,
            float(result.loss or 0.0),
            float(result.grad_norm or 0.0),
            result.lr,
            result.step_time_s,
            t.tokens_per_step,
            t.world_size,
            t.flops_per_token,
            self.peak_tflops,
            mem,
            kind,
            result.aux_loss,
            result.expert_load,
        )

    def close(self) -> None:
        self.metrics.close()
        if self.exporter is not None:
            self.exporter.close()
