"""`hpkit train`: the training loop that runs inside the job.

Order of construction (as in torchtitan): the model is built on the meta device, split into a
pipeline stage, then tensor parallel -> activation checkpointing -> compile -> FSDP are applied,
and only then are the weights materialised and initialised, each rank allocating only its shards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hpkit.errors import SpecError
from hpkit.spec import (
    CheckpointSpec,
    CollectivesSpec,
    ModelSpec,
    ParallelismSpec,
    ResilienceSpec,
    TrainSpec,
    load_spec,
    read_document,
)

SPEC_ENV = "HPKIT_SPEC"
_BLOCKS = ("parallelism", "model", "train", "checkpoint")


@dataclass(frozen=True)
class RunConfig:
    """What the runtime needs from a job spec: a whole JobSpec file, or just its training blocks."""

    name: str = "train"
    output_dir: str = "logs"
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    # From the whole job spec only; a config of bare training blocks gets the defaults.
    resilience: ResilienceSpec = field(default_factory=ResilienceSpec)
    collectives: CollectivesSpec = field(default_factory=CollectivesSpec)
    instance_type: str | None = None

    @classmethod
    def from_blocks(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        unknown = set(data) - {*_BLOCKS, "name", "output_dir"}
        if unknown:
            raise SpecError(
                f"{source}: unknown key(s) {', '.join(sorted(unknown))}; a training config has "
                f"{', '.join(_BLOCKS)}, name and output_dir (or is a whole job spec with name:)"
            )
        kinds = {
            "parallelism": ParallelismSpec,
            "model": ModelSpec,
            "train": TrainSpec,
            "checkpoint": CheckpointSpec,
        }
        blocks: dict[str, Any] = {}
        for key, kind in kinds.items():
            try:
                blocks[key] = kind.model_validate(data.get(key) or {})
            except ValidationError as exc:
                lines = []
                for err in exc.errors():
                    where = ".".join(str(p) for p in (key, *err["loc"]))
                    lines.append(f"{source}: {where}: {err['msg'].removeprefix('Value error, ')}")
                raise SpecError("\n".join(lines)) from None
        return cls(
            name=str(data.get("name", "train")), output_dir=str(data.get("output_dir", "logs")), **blocks
        )


def load_run_config(path: str | Path) -> RunConfig:
    path = Path(path)
    data = read_document(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a training config is a mapping of keys, not {type(data).__name__}")
    if "name" in data and not set(data) <= {*_BLOCKS, "name", "output_dir"}:
        spec = load_spec(path)  # a whole job spec: validate all of it, as submit did
        return RunConfig(
            spec.name,
            spec.output_dir,
            spec.parallelism,
            spec.model,
            spec.train,
            spec.checkpoint,
            spec.resilience,
            spec.collectives,
            spec.instance_type,
        )
    return RunConfig.from_blocks(data, str(path))


# --------------------------------------------------------------------------------------------------
# Building the model for a layout


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float


class Trainer:
    """One training run on an initialised process group; it owns its mesh, model, optimizer and data."""

    def __init__(self, cfg: RunConfig, device, *, metrics=None, checkpointer=None) -> None:
        import torch
        import torch.distributed as dist

        from hpkit.models.llama import build_model, config_for
        from hpkit.runtime import data as data_mod
        from hpkit.runtime.activation_checkpoint import apply_ac
        from hpkit.runtime.compile import apply_compile, check_compile_allowed
        from hpkit.runtime.fsdp import apply_ddp, apply_fsdp
        from hpkit.runtime.parallel_dims import ParallelDims, make_mesh
        from hpkit.runtime.pipeline import build_schedule, check_microbatches, split_model
        from hpkit.runtime.tensor_parallel import apply_tp, check_tp_shape

        self.cfg = cfg
        self.device_info = device
        self.device = device.torch_device()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        tr = cfg.train
        self.mixed_precision = resolve_mixed_precision(tr.mixed_precision, device.type)
        self.dims = ParallelDims.from_spec(cfg.parallelism, self.world_size)
        check_compile_allowed(tr.compile, self.dims.tp_enabled, device.type)
        if self.dims.pp_enabled:
            check_microbatches(tr.local_batch_size, cfg.parallelism.microbatches)
        self.coords = make_mesh(self.dims, device.type)
        m = cfg.model
        try:
            self.model_cfg = config_for(
                m.name,
                m.seq_len,
                vocab_size=m.vocab_size,
                dim=m.dim,
                n_layers=m.n_layers,
                n_heads=m.n_heads,
                n_kv_heads=m.n_kv_heads,
                ffn_dim=m.ffn_dim,
            )
        except ValueError as exc:
            raise SpecError(f"model: {exc}") from None

        torch.manual_seed(tr.seed)
        whole = build_model(self.model_cfg, "meta")
        pp_stage = self.coords.pp_rank
        part = split_model(whole, self.dims.pp, pp_stage)
        self.is_first_stage = pp_stage == 0
        self.is_last_stage = pp_stage == self.dims.pp - 1

        if self.dims.tp_enabled:
            whole_model = cfg.parallelism.tp_modules is None
            check_tp_shape(part, self.dims.tp, m.seq_len, whole_model)
            apply_tp(part, self.coords.tp_mesh, cfg.parallelism.tp_modules)
        apply_ac(part, tr.activation_checkpoint)
        if tr.compile:
            apply_compile(part)
        if self.dims.fsdp_enabled:
            apply_fsdp(part, self.coords.fsdp_mesh, self.mixed_precision, self.dims.pp_enabled)
        part.to_empty(device=self.device)
        part.init_weights(tr.seed)
        self.model = part
        module = part
        if self.dims.ddp_enabled:
            module = apply_ddp(part, self.coords.ddp_mesh, self.device)
        self.module = module
        # FSDP casts parameters itself; otherwise bf16 comes from autocast around the forward.
        self.autocast = self.mixed_precision == "bf16" and not self.dims.fsdp_enabled

        self.schedule = None
        if self.dims.pp_enabled:
            self.schedule = build_schedule(
                module,
                self.coords.pp_mesh,
                self.device,
                cfg.parallelism.microbatches,
                cfg.parallelism.pp_schedule,
                self._loss,
            )

        params = [p for p in part.parameters() if p.requires_grad]
        self.params = params
        self.optimizer = torch.optim.AdamW(
            params,
            lr=tr.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=tr.weight_decay,
            # foreach kernels need all DTensors on one mesh; TP on chosen modules mixes meshes.
            foreach=_single_mesh(params),
        )

        source = data_mod.build_source(
            tr.data.kind, tr.data.path, tr.data.dtype, m.seq_len, tr.seed, self.model_cfg.vocab_size
        )
        self.loader = data_mod.DataLoader(
            source, tr.local_batch_size, dp_rank=self.coords.dp_rank, dp_degree=self.dims.dp
        )
        self.step = 0
        self.metrics = metrics
        self.checkpointer = checkpointer
        self.flops_per_token = self.model_cfg.flops_per_token(m.seq_len)
        # The handler only records the signal; ranks act on it after agreeing in the step's all-reduce,
        # or a rank signalled between two reductions would go to save while the others train on.
        self._signal_received = 0
        self._stop_signal = 0

    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def _loss(logits, labels):
        import torch.nn.functional as F

        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def _autocast(self):
        import torch

        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def lr_at(self, step: int) -> float:
        tr = self.cfg.train
        if tr.warmup_steps and step <= tr.warmup_steps:
            return tr.lr * step / tr.warmup_steps
        return tr.lr

    def checkpoint_state(self) -> dict[str, Any]:
        from hpkit.runtime.checkpoint import ModelState, OptimizerState, TrainState

        self._train_state = TrainState(self.step, self.loader)
        return {
            "model": ModelState([self.model]),
            "optimizer": OptimizerState([self.model], [self.optimizer]),
            "train": self._train_state,
        }

    def resume(self) -> Path | None:
        from torch.distributed.checkpoint.api import CheckpointException

        if self.checkpointer is None or not self.cfg.checkpoint.resume:
            return None
        for path in self.checkpointer.candidates():
            try:
                self.checkpointer.load(self.checkpoint_state(), path)
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException, raised on every rank
                if self.rank == 0:
                    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                    print(
                        f"hpkit train: warning: skipping unreadable checkpoint {path} ({reason})", flush=True
                    )
                continue
            self.step = self._train_state.step
            return path
        return None

    def save(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save(self.step, self.checkpoint_state())

    def train_step(self) -> StepResult:
        import torch
        import torch.distributed as dist

        from hpkit.runtime.grad_norm import clip_grads_, total_grad_norm

        start = time.perf_counter()
        self.step += 1
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, labels = self.loader.next_batch()
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)

        if self.schedule is None:
            with self._autocast():
                logits = self.module(inputs)
            loss = self._loss(logits, labels)
            loss.backward()
            local_loss = loss.detach()
        else:
            losses: list[torch.Tensor] = []
            with self._autocast():
                if self.is_first_stage:
                    self.schedule.step(inputs)
                elif self.is_last_stage:
                    self.schedule.step(target=labels, losses=losses)
                else:
                    self.schedule.step()
            local_loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

        pp_group = self.coords.pp_mesh.get_group() if self.dims.pp_enabled else None
        norm = total_grad_norm(self.params, pp_group)
        if self.cfg.train.grad_clip is not None:
            clip_grads_(self.params, self.cfg.train.grad_clip, norm)
        if self.checkpointer is not None:
            self.checkpointer.wait_for_staging()  # an async save may still be copying these weights
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        # One collective per step: the global mean loss (only the last stage's first tp rank holds a
        # copy to count) and whether any rank was asked to stop.
        counts = self.is_last_stage and self.coords.tp_rank == 0
        packed = torch.stack(
            [
                local_loss.float() if counts else torch.zeros((), device=self.device),
                torch.tensor(float(self._signal_received), device=self.device),
            ]
        )
        dist.all_reduce(packed)
        loss_value, stop = (packed / torch.tensor([self.dims.dp, 1.0], device=self.device)).tolist()
        if stop:
            self._stop_signal = self._signal_received or signal.SIGTERM
        return StepResult(self.step, loss_value, float(norm), lr, time.perf_counter() - start)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.local_batch_size * self.dims.dp * self.cfg.model.seq_len

    def request_stop(self, signum: int) -> None:
        self._signal_received = signum

    @property
    def stop_requested(self) -> bool:
        return bool(self._stop_signal)

    @property
    def stop_signal(self) -> int:
        return int(self._stop_signal)


def resolve_mixed_precision(setting: str, device_type: str) -> str:
    if setting == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return setting


def _single_mesh(params) -> bool | None:
    from torch.distributed.tensor import DTensor

    meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
    return None if len(meshes) <= 1 else False


# --------------------------------------------------------------------------------------------------
# The command


def _parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description="Run the training loop (inside a job).")
    parser.add_argument(
        "--config",
        default=os.environ.get(SPEC_ENV),
        help=f"job spec or training config YAML (default: ${SPEC_ENV}, which the sbatch script exports)",
    )
    parser.add_argument("--steps", type=int, help="override train.steps")
    return parser.parse_args(argv)


def main(argv: list[str], prog: str = "hpkit train") -> int:
    args = _parse_args(argv[1:] if argv and argv[0] == "train" else argv, prog)
    if not args.config:
        raise SpecError(f"no config: pass --config job.yaml or export {SPEC_ENV}")
    cfg = load_run_config(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise SpecError("--steps must be at least 1")
        cfg = dataclasses.replace(cfg, train=cfg.train.model_copy(update={"steps": args.steps}))
    return run(cfg)


def quiet_known_warnings() -> None:
    """Silence two warnings that do not apply to how the runtime uses torch, so real ones stand out."""
    import logging
    import warnings

    # The logits are never modified in place, which is what this warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            # Reducing the scalar gradient norm over a 2-D mesh in two steps costs microseconds.
            return "sequential all_reduce operations" not in record.getMessage()

    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_Drop())


def expand_job_pattern(path: str) -> str:
    """%j -> the Slurm job id, as in sbatch's --output: a requeued job keeps its id (and resumes its own
    checkpoints), a new submission starts a fresh directory."""
    return path.replace(
        "%j", os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    )


def choose_collectives(cfg: RunConfig, launch, device):
    """On GPUs, SMDDP instead of NCCL where the spec asks for it and it can run (else why not, in one line)."""
    if device.type != "cuda":
        return device
    from hpkit.sagemaker.smddp import decide

    choice = decide(cfg.collectives.backend, cfg.collectives.smddp_fallback, cfg.instance_type)
    if launch.rank == 0 and cfg.collectives.backend != "auto":
        print(f"hpkit train: {choice.reason}", flush=True)
    if not choice.usable:
        raise SpecError(choice.reason)
    return dataclasses.replace(device, backend=choice.backend)


def run(cfg: RunConfig) -> int:
    from hpkit.runtime.env import choose_device, configure_threads, init_distributed, read_launch_env

    quiet_known_warnings()
    launch = read_launch_env()
    configure_threads(launch)
    device = choose_collectives(cfg, launch, choose_device(launch))
    # A collective stuck on a dead peer fails after this long instead of hanging the job.
    init_distributed(launch, device, timeout_s=cfg.resilience.collective_timeout_s)
    import torch.distributed as dist

    try:
        code = _run_initialised(cfg, launch, device)
        # Let every rank's last sends (pipeline stages, async checkpoint) land before any rank tears
        # its communicators down.
        dist.barrier()
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_initialised(cfg: RunConfig, launch, device) -> int:
    from hpkit.runtime.checkpoint import Checkpointer
    from hpkit.runtime.metrics import MetricsLogger, StepStats, peak_memory_gib, peak_tflops

    rank0 = launch.rank == 0
    out = Path(cfg.output_dir)
    run_id = (
        os.environ.get("SLURM_JOB_ID")
        or os.environ.get("TORCHELASTIC_RUN_ID")
        or time.strftime("%Y%m%d-%H%M%S")
    )
    run_id = run_id if run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    metrics_path = (
        out / cfg.train.metrics_file if cfg.train.metrics_file else out / f"{cfg.name}-{run_id}.metrics.jsonl"
    )
    metrics = MetricsLogger(
        enabled=rank0,
        jsonl_path=metrics_path,
        tensorboard_dir=out / "tensorboard" / f"{cfg.name}-{run_id}" if cfg.train.tensorboard else None,
    )
    ck = cfg.checkpoint
    checkpointer = (
        Checkpointer(expand_job_pattern(ck.dir), ck.keep, ck.async_save, launch.rank, ck.writer_threads)
        if ck.dir
        else None
    )
    trainer = Trainer(cfg, device, metrics=metrics, checkpointer=checkpointer)
    say = print if rank0 else (lambda *a, **k: None)
    say(
        f"hpkit train: {cfg.name}: model {cfg.model.name} ({trainer.model_cfg.num_params() / 1e6:.2f}M params), "
        f"{trainer.dims.describe()} on {launch.world_size} {device.type} rank(s) ({device.backend}, "
        f"launched by {launch.source}), {cfg.train.steps} steps of {trainer.tokens_per_step} tokens",
        flush=True,
    )
    resumed = trainer.resume()
    if resumed is not None:
        say(f"hpkit train: resumed from {resumed} at step {trainer.step}", flush=True)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    for sig in previous:
        # Slurm sends SIGTERM (or the --signal one) before killing: finish the step, save, then stop.
        signal.signal(sig, lambda signum, _frame: trainer.request_stop(signum))
    peak = peak_tflops(device.name, device.type, trainer.mixed_precision)
    timed_tokens, timed_s, timed_steps, last = 0, 0.0, 0, None
    first_step = trainer.step + 1
    try:
        while trainer.step < cfg.train.steps:
            result = trainer.train_step()
            last = result
            if not math.isfinite(result.loss):
                raise SpecError(f"the loss became {result.loss} at step {result.step}: lower train.lr")
            # The first step pays for allocation, compile and communicator setup: keep it out of the average.
            if result.step > first_step or cfg.train.steps == first_step:
                timed_tokens += trainer.tokens_per_step
                timed_s += result.step_time_s
                timed_steps += 1
            if result.step % cfg.train.log_every == 0 or result.step == cfg.train.steps:
                mem, kind = peak_memory_gib(trainer.device)
                metrics.log(
                    StepStats(
                        result.step,
                        result.loss,
                        result.grad_norm,
                        result.lr,
                        result.step_time_s,
                        trainer.tokens_per_step,
                        launch.world_size,
                        trainer.flops_per_token,
                        peak,
                        mem,
                        kind,
                    )
                )
            if checkpointer and (result.step % ck.interval == 0 or trainer.stop_requested):
                trainer.save()
            if trainer.stop_requested:
                say(
                    f"hpkit train: stopping at step {trainer.step} on signal {trainer.stop_signal}",
                    flush=True,
                )
                break
        unsaved = last is not None and last.step % ck.interval != 0 and not trainer.stop_requested
        if checkpointer and ck.save_final and unsaved:
            trainer.save()
        if checkpointer:
            checkpointer.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        metrics.close()

    if last is None:
        say(f"hpkit train: nothing to do: already at step {trainer.step} of {cfg.train.steps}", flush=True)
        return 0
    tps = timed_tokens / timed_s if timed_s > 0 else 0.0
    tflops = trainer.flops_per_token * tps / launch.world_size / 1e12
    mfu = f"{tflops / peak * 100:.1f}%" if peak else "n/a"
    layout = ",".join(f"{k}:{v}" for k, v in trainer.dims.degrees().items() if v > 1) or "single"
    say(
        f"hpkit train: done steps={last.step} final_loss={last.loss:.4f} tokens_per_s={tps:.0f} "
        f"tflops_per_device={tflops:.3f} mfu={mfu} step_ms={timed_s / max(1, timed_steps) * 1000:.0f} "
        f"world={launch.world_size} layout={layout} device={device.type}",
        flush=True,
    )
    return 128 + trainer.stop_signal if trainer.stop_requested else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
