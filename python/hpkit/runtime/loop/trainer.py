"""The Trainer: one training run's model, optimizer and data on an initialised process group.

The model comes from its family's adapter (hpkit.models.adapters, looked up by `model.name`), which the
parallelisms below ask about the model's structure. Order of construction (as in torchtitan): the model
is built on the meta device, split into this rank's pipeline stages (`model_parts`: one part, or
`stages_per_rank` under an interleaved schedule), then tensor parallel -> activation checkpointing ->
compile -> FSDP are applied to each part, and only then are the weights materialised and initialised,
each rank allocating only its shards.

The Trainer is itself a DCP `Stateful`: its state is the step, the data position and the RNG, saved
beside the model and optimizer. The host reads values from the device (loss, grad norm, the stop
flag) only on logging steps, so a GPU is never made to wait for the CPU between them.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpkit.errors import SpecError
from hpkit.layout_rules.pipeline import stages_problem
from hpkit.models.adapters import adapter_for
from hpkit.models.families import family_for, hf_family
from hpkit.models.llama.moe import MoE
from hpkit.runtime.checkpoints.checkpoint import Checkpointer, ModelState, OptimizerState
from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
from hpkit.runtime.config import RunConfig, resolve_mixed_precision
from hpkit.runtime.env import DeviceInfo, node_name
from hpkit.runtime.loop import data as data_mod
from hpkit.runtime.loop.grad_norm import clip_grads_, total_grad_norm
from hpkit.runtime.loop.lora import apply_lora, base_identity, init_lora, lora_record, resume_refusal
from hpkit.runtime.loop.loss import TokenWeightedLoss
from hpkit.runtime.parallel.activation_checkpoint import apply_ac
from hpkit.runtime.parallel.compile import apply_compile, check_compile_allowed
from hpkit.runtime.parallel.expert_parallel import apply_ep
from hpkit.runtime.parallel.fsdp import apply_ddp, apply_fsdp
from hpkit.runtime.parallel.parallel_dims import ParallelDims, make_mesh
from hpkit.runtime.parallel.pipeline import build_schedule, check_microbatches, split_model, stage_ids
from hpkit.runtime.parallel.tensor_parallel import apply_tp, check_tp_shape, sequence_parallel_default
from hpkit.runtime.watchdog.stragglers import StragglerMonitor, Window

# Debug: a directory where each rank appends "sample-index sha1" per sample it trains on (tests compare runs).
DIGESTS_ENV = "HPKIT_DATA_DIGESTS"


@dataclass
class StepResult:
    """One step. `loss` and `grad_norm` are read to the host only on logging steps (else None)."""

    step: int
    lr: float
    step_time_s: float
    loss: float | None = None
    grad_norm: float | None = None
    aux_loss: float | None = None  # MoE models: see hpkit.metrics.records.StepRecord
    expert_load: float | None = None
    window: Window | None = None  # a straggler window's verdict, on the step after the window ended

    @property
    def logged(self) -> bool:
        return self.loss is not None


class StopFlag:
    """Whether any rank was signalled, agreed without stalling a step.

    Each step starts a non-blocking all-reduce (MAX) of this rank's flag on a CPU group of its own;
    the next step reads the result. A signal therefore stops every rank at the same step, at most one
    step after the step in which it arrived was checked.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.received = 0
        self.agreed = 0
        self._pending: tuple[Any, torch.Tensor] | None = None

    def request(self, signum: int) -> None:
        self.received = signum

    def exchange(self) -> None:
        """Collect the previous step's verdict and start this step's."""
        self.settle()
        flag = torch.tensor([self.received], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, flag)

    def settle(self) -> None:
        """Finish the reduction in flight (before reading `agreed`, and before teardown)."""
        if self._pending is not None:
            work, flag = self._pending
            self._pending = None
            work.wait()
            self.agreed = self.agreed or int(flag.item())


class Trainer:
    """One training run; it owns its mesh, model, optimizer and data, and is DCP-Stateful."""

    def __init__(self, cfg: RunConfig, device: DeviceInfo) -> None:
        self.cfg = cfg
        self.device_info = device
        self.device = device.torch_device()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._init_layout(cfg, device)
        self._init_model_config(cfg)
        self._init_stages(cfg, device)
        self._init_model()
        self.pp_group = self.coords.pp_mesh.get_group() if self.dims.pp_enabled else None
        self.step = 0
        self.flops_per_token = self.adapter.flops_per_token(self.model_cfg, cfg.model.seq_len)
        self._init_host_side()

    # ----------------------------------------------------------------------------------------------
    # Construction

    def _init_layout(self, cfg: RunConfig, device: DeviceInfo) -> None:
        """The precision, the parallel degrees (checked against what the device allows) and the mesh."""
        self.mixed_precision = resolve_mixed_precision(cfg.train.mixed_precision, device.type)
        self.dims = ParallelDims.from_spec(cfg.parallelism, self.world_size)
        check_compile_allowed(cfg.train.compile, self.dims.tp_enabled, device.type)
        if self.dims.pp_enabled:
            check_microbatches(cfg.train.local_batch_size, cfg.parallelism.microbatches)
        self.coords = make_mesh(self.dims, device.type)

    def _init_model_config(self, cfg: RunConfig) -> None:
        """The model family's adapter, the model's shape (from init_from's config.json when given) and LoRA's
        record."""
        # The model family's adapter builds, splits and parallelises the model (hpkit.models.adapters).
        family = (
            hf_family(cfg.model.init_from)
            if cfg.model.init_from
            else family_for(cfg.model.name, cfg.model.moe is not None)
        )
        self.adapter = adapter_for(family)
        # A Hugging Face checkpoint (model.init_from) gives the shape; its weights are loaded by
        # load_pretrained once resuming has found no checkpoint of this run.
        self.hf = self._hf_model() if cfg.model.init_from else None
        self.model_cfg = self.hf.cfg if self.hf else self.adapter.config(cfg.model.named_shape())
        # LoRA: the adapters' settings and the base's identity, recorded in every checkpoint.
        self.lora = (
            lora_record(
                cfg.model.lora,
                base_identity(
                    cfg.model.init_from, self.adapter.config_to_dict(self.model_cfg), cfg.train.seed
                ),
            )
            if cfg.model.lora is not None
            else None
        )

    def _init_stages(self, cfg: RunConfig, device: DeviceInfo) -> None:
        """The pipeline stages this rank holds, and how tensor parallel shards the loss and the sequence."""
        par = cfg.parallelism
        self.n_stages = self.dims.pp * par.stages_per_rank
        # The spec's validator checks this only when model.n_layers is written; the shape knows it always.
        if problem := stages_problem(self.dims.pp, par.stages_per_rank, self.model_cfg.n_layers):
            raise SpecError(problem)
        # The pipeline stages this rank holds; the V placement puts the first and the last on one rank.
        self.pp_stages = stage_ids(self.coords.pp_rank, self.dims.pp, par.stages_per_rank, par.pp_schedule)
        self.is_first_stage = 0 in self.pp_stages
        self.is_last_stage = self.n_stages - 1 in self.pp_stages
        # Whole-model TP without PP: the loss runs on vocabulary-sharded logits (see apply_tp).
        self.loss_parallel = (
            self.dims.tp_enabled and cfg.parallelism.tp_modules is None and not self.dims.pp_enabled
        )
        self.sequence_parallel = (
            cfg.parallelism.sequence_parallel
            if cfg.parallelism.sequence_parallel is not None
            else sequence_parallel_default(device.type)
        )

    def _init_model(self) -> None:
        """The model's parts, parallelised; the loss, the pipeline schedule, the optimizers and the loader."""
        self.model_parts, self.module = self._build_model()
        self.moe_blocks = self._moe_blocks()
        # FSDP casts parameters itself; otherwise bf16 comes from autocast around the forward.
        self.autocast = self.mixed_precision == "bf16" and not self.dims.fsdp_enabled
        # The step's loss: token-weighted over every microbatch and data-parallel rank (runtime.loop.loss).
        self.loss = TokenWeightedLoss(self.dims.dp, masked=False)
        self.schedule = self._build_schedule()
        if self.schedule is not None:
            # torch's pipeline stages infer their shapes by running one forward (and input-gradient pass)
            # before the first real microbatch: keep it out of the MoE load figures.
            for _, moe in self.moe_blocks:
                moe.skip_forwards = 1
                # The schedule sums its microbatches' gradients (scale_grads off, runtime.loop.loss): each
                # microbatch's auxiliary loss is its 1/microbatches share of the batch's, as one forward's is.
                moe.aux_grad_scale = 1.0 / self.cfg.parallelism.microbatches
        self.params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        # One optimizer per part: DCP's optimizer state dict maps parameters to names through one module.
        self.optimizers = [self._build_optimizer(part) for part in self.model_parts]
        self.loader = self._build_loader()
        self.loss.masked = self.loader.masked

    def _init_host_side(self) -> None:
        # Host-side agreements (the stop flag, straggler windows) travel on a CPU group of their own, so
        # that they never queue behind the device's collectives.
        self.cpu_group = dist.new_group(backend="gloo")
        self.stop = StopFlag(self.cpu_group)
        self.stragglers = (
            StragglerMonitor(self.cfg.train.stragglers, self.cpu_group, self.device, node_name())
            if self.cfg.train.stragglers.enabled
            else None
        )
        self._work = self.stragglers.timer if self.stragglers is not None else _NoTimer()

    def _hf_model(self) -> Any:
        hf = self.adapter.hf
        if hf is None:
            raise SpecError(f"model.init_from: the {self.adapter.family} family has no Hugging Face format")
        return hf.read_config(self.cfg.model.init_from, self.cfg.model.seq_len)

    def _build_model(self) -> tuple[list[torch.nn.Module], torch.nn.Module]:
        torch.manual_seed(self.cfg.train.seed)
        whole = self.adapter.build(self.model_cfg, "meta")
        parts = [
            self._parallelize(split_model(whole, self.n_stages, stage, self.adapter))
            for stage in self.pp_stages
        ]
        # Without a pipeline the one part is the whole model, run directly (under DDP if replicated).
        module = apply_ddp(parts[0], self.coords.ddp_mesh, self.device) if self.dims.ddp_enabled else parts[0]
        return parts, module

    def _parallelize(self, part: torch.nn.Module) -> torch.nn.Module:
        """TP, activation checkpointing, compile and FSDP on one model part, then its weights."""
        cfg, tr, adapter = self.cfg, self.cfg.train, self.adapter
        if self.dims.tp_enabled:
            whole_model = cfg.parallelism.tp_modules is None
            check_tp_shape(
                part, self.dims.tp, cfg.model.seq_len, whole_model, self.sequence_parallel, adapter
            )
            apply_tp(
                part,
                self.coords.tp_mesh,
                cfg.parallelism.tp_modules,
                self.loss_parallel,
                self.sequence_parallel,
                adapter,
            )
        if self.dims.ep_enabled and not apply_ep(part, self.coords.ep_mesh, adapter):
            raise SpecError(
                f"parallelism.ep={self.dims.ep} splits experts, but the model has none: set model.moe"
            )
        if cfg.model.lora is not None:
            # After TP and EP (the adapters take the base's tensor-parallel layout), before AC and FSDP.
            apply_lora(part, cfg.model.lora, adapter, self.mixed_precision, self.dims.fsdp_enabled)
        apply_ac(part, tr.activation_checkpoint, adapter)
        if tr.compile:
            apply_compile(part, adapter)
        if self.dims.fsdp_enabled:
            apply_fsdp(
                part,
                self.coords.fsdp_mesh,
                self.mixed_precision,
                self.dims.pp_enabled,
                adapter,
                expert_mesh=self.coords.expert_fsdp_mesh,
            )
        part.to_empty(device=self.device)
        adapter.init_weights(part, tr.seed)
        if cfg.model.lora is not None:
            init_lora(part, tr.seed)
        return part

    def _moe_blocks(self) -> list[tuple[int, MoE]]:
        """This rank's MoE FFNs with their row among all of the model's MoE blocks (for the load figures)."""
        moe_cfg = getattr(self.model_cfg, "moe", None)
        if moe_cfg is None:
            return []
        rows = {block: row for row, block in enumerate(moe_cfg.moe_blocks(self.model_cfg.n_layers))}
        found = []
        for part in self.model_parts:
            for name, block in self.adapter.blocks(part).items():
                found += [(rows[int(name)], m) for m in block.modules() if isinstance(m, MoE)]
        return found

    def _moe_figures(self, logging: bool) -> tuple[float | None, float | None]:
        """(aux loss, expert load) over the whole job on a logging step; the counters restart every step."""
        stats = [(row, m.take_stats()) for row, m in self.moe_blocks]
        if not logging or not self.model_cfg.moe:
            return None, None
        n_experts = self.model_cfg.moe.experts
        table = torch.zeros(len(self.model_cfg.moe.moe_blocks(self.model_cfg.n_layers)), n_experts + 2)
        for row, (load, aux_sum, calls) in stats:
            table[row, :n_experts] = load.float().cpu()
            table[row, n_experts] = float(aux_sum)
            table[row, n_experts + 1] = float(calls)
        # Summed over every rank: tp ranks count the same tokens, which scales a block's row evenly.
        dist.all_reduce(table, group=self.cpu_group)
        load, aux_sum, calls = table[:, :n_experts], table[:, n_experts], table[:, n_experts + 1]
        aux = float((aux_sum / calls.clamp(min=1)).mean())
        balance = float((load.max(1).values / load.mean(1).clamp(min=1e-9)).max())
        return aux, balance

    def _build_schedule(self) -> Any:
        if not self.dims.pp_enabled:
            return None
        par = self.cfg.parallelism
        return build_schedule(
            self.model_parts,
            self.coords.pp_mesh,
            self.device,
            par.microbatches,
            par.pp_schedule,
            self.loss,
            scale_grads=False,
        )

    def _build_optimizer(self, part: torch.nn.Module) -> torch.optim.Optimizer:
        tr = self.cfg.train
        params = [p for p in part.parameters() if p.requires_grad]
        # The fused kernel (CPU and CUDA) updates each parameter in one pass; foreach runs a dozen
        # elementwise kernels over the whole list and cost 5x the time in a CPU profile. One kernel call
        # needs all its DTensors on one mesh, and AdamW calls it once per parameter group: so one group
        # per mesh (experts live on their own mesh under ep; TP on chosen modules mixes plain tensors in).
        by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
        for p in params:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        return torch.optim.AdamW(
            [{"params": group} for group in by_mesh.values()],
            lr=tr.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=tr.weight_decay,
            fused=True,
        )

    def _build_loader(self) -> data_mod.DataLoader:
        tr, m = self.cfg.train, self.cfg.model
        source = data_mod.build_source(
            tr.data.kind, tr.data.path, tr.data.dtype, m.seq_len, tr.seed, self.model_cfg.vocab_size
        )
        digests = os.environ.get(DIGESTS_ENV)
        return data_mod.DataLoader(
            source,
            tr.local_batch_size,
            dp_rank=self.coords.dp_rank,
            dp_degree=self.dims.dp,
            # Line-buffered: a run killed with -9 still leaves every line it wrote whole.
            digests=open(Path(digests) / f"rank-{self.rank}.log", "a", buffering=1) if digests else None,
        )

    def reset(self) -> None:
        """Back to the freshly initialised state: after a failed resume may have loaded part of a checkpoint."""
        torch.manual_seed(self.cfg.train.seed)
        for part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            self.adapter.init_weights(part, self.cfg.train.seed)
            if self.cfg.model.lora is not None:
                init_lora(part, self.cfg.train.seed)
            optimizer.state.clear()
        self.step = 0
        self.loader.position = 0

    # ----------------------------------------------------------------------------------------------
    # Checkpoint state (DCP Stateful)

    # A checkpoint saved on a CPU holds no CUDA RNG state: resumed on a GPU, that generator keeps its seed.
    optional_state_keys = ("rng_cuda",)

    def state_dict(self) -> dict[str, Any]:
        # Every rank seeds alike and draws in lockstep, so one copy of the RNG state suffices.
        state = {
            "step": torch.tensor(self.step),
            "data_position": torch.tensor(self.loader.position),
            "rng_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loader.position = int(state["data_position"])
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            # Under LoRA only the adapters: the frozen base is init_from's (or the seed's), unchanged.
            "model": ModelState(self.model_parts, trainable_only=self.cfg.model.lora is not None),
            "optimizer": OptimizerState(self.model_parts, self.optimizers),
            "train": self,
        }

    def load_pretrained(self) -> Any:
        """Overwrite the initialised weights with model.init_from's, each rank reading only its shards."""
        assert self.hf is not None and self.cfg.model.init_from
        try:
            from hpkit.hf.load import LoadStats, load_hf_weights
        except ImportError as exc:
            raise SpecError(
                f"model.init_from needs the hf extra ({exc.name} is missing): pip install 'hpkit[train,hf]'"
            ) from None
        stats = [
            load_hf_weights(part, self.cfg.model.init_from, self.hf, self.adapter.hf)
            for part in self.model_parts
        ]
        return LoadStats(sum(s.tensors for s in stats), sum(s.bytes_read for s in stats))

    def model_record(self) -> dict[str, Any]:
        """What a checkpoint's commit record keeps of the model: enough for `hpkit ckpt export --hf`."""
        return {
            "family": self.adapter.family,
            "config": self.adapter.config_to_dict(self.model_cfg),
            "hf": dict(self.hf.extras) if self.hf else {},
            "init_from": self.cfg.model.init_from,
            **({"lora": self.lora} if self.lora is not None else {}),
        }

    def checkpoint_refusal(self, record: Any, path: Path) -> str | None:
        """Why this run must not resume the checkpoint whose commit record is `record` (LoRA adapters on
        another base, adapters for a whole-model run or the reverse), or None."""
        theirs = (record.model or {}).get("lora")
        return resume_refusal(theirs, self.lora, f"checkpoint {path}")

    def resume(self, checkpointer: Checkpointer) -> Path | None:
        """Load the newest usable checkpoint, agreed by every rank; None (and a fresh start) if none is."""
        path, dirty = checkpointer.restore(self.checkpoint_state())
        if path is None and dirty:
            self.reset()
        return path

    # ----------------------------------------------------------------------------------------------
    # One step

    def lr_at(self, step: int) -> float:
        tr = self.cfg.train
        if tr.warmup_steps and step <= tr.warmup_steps:
            return tr.lr * step / tr.warmup_steps
        return tr.lr

    def is_logging_step(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def train_step(self, *savers: Checkpointer | MemoryCheckpointer | None) -> StepResult:
        start = time.perf_counter()
        self.step += 1
        lr = self.lr_at(self.step)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        # self._work measures what waits for no other rank: this rank's speed (see stragglers.WorkTimer).
        with self._work.step():
            with self._work.host():
                inputs, labels, positions = self.loader.next_batch_with_positions()
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
            self.loss.begin_step(labels)
            if positions is not None:  # packed conversations: positions restart at each (runtime.loop.data)
                positions = positions.to(self.device, non_blocking=True)
            local_loss = self._forward_backward(inputs, labels, positions)
            norm = total_grad_norm(self.params, self.pp_group)
            if self.cfg.train.grad_clip is not None:
                with self._work.device():
                    clip_grads_(self.params, self.cfg.train.grad_clip, norm)
            for saver in savers:  # an async save may still be copying these weights
                if saver is not None:
                    saver.wait_for_staging()
            with self._work.device():
                for optimizer in self.optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            self.stop.exchange()
            result = StepResult(self.step, lr, 0.0)
            logging = self.is_logging_step(self.step)
            result.aux_loss, result.expert_load = self._moe_figures(logging)
            if logging:
                result.loss = self._global_loss(local_loss)
                result.grad_norm = float(norm)
        result.step_time_s = time.perf_counter() - start
        if self.stragglers is not None:
            result.window = self.stragglers.end_step(self.step, result.step_time_s)
        return result

    def _forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Packed documents' positions go to every stage (keyword arguments reach each), as the model's
        # `positions`: it restarts rotary positions and keeps attention inside each document.
        extra = {"positions": positions} if positions is not None else {}
        if self.schedule is None:
            # Under loss parallel both the loss and its backward must run inside the context.
            with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                with self._autocast():
                    logits = self.module(inputs, **extra)
                loss = self.loss(logits, labels)
                loss.backward()
            # A loss-parallel loss is a DTensor replicated over the tp group: every rank holds it whole.
            return (loss.to_local() if isinstance(loss, DTensor) else loss).detach()
        losses: list[torch.Tensor] = []
        # The rank with the first stage feeds the inputs; the one with the last, the labels (V: one rank).
        args = (inputs,) if self.is_first_stage else ()
        kwargs = {"target": labels, "losses": losses} if self.is_last_stage else {}
        with self._autocast():
            self.schedule.step(*args, **kwargs, **extra)
        # The schedules hand the losses back as the loss function made them, requiring grad; each is its
        # microbatch's share of the rank's loss (runtime.loop.loss), so they add up.
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)

    def _global_loss(self, local_loss: torch.Tensor) -> float:
        # Only the last stage's first tp rank holds a copy of each data-parallel rank's loss to count. Each
        # is the rank's counted sum / (global count / dp): their sum / dp is the step's token-weighted mean.
        counts = self.is_last_stage and self.coords.tp_rank == 0
        total = local_loss.float() if counts else torch.zeros((), device=self.device)
        dist.all_reduce(total)
        return float(total) / self.dims.dp

    def _autocast(self) -> Any:
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ----------------------------------------------------------------------------------------------
    # Stopping on a signal

    def request_stop(self, signum: int) -> None:
        """Signal handlers call this: it only records; the ranks act once they agree (StopFlag)."""
        self.stop.request(signum)

    @property
    def stop_requested(self) -> bool:
        return bool(self.stop.agreed)

    @property
    def stop_signal(self) -> int:
        return self.stop.agreed

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.local_batch_size * self.dims.dp * self.cfg.model.seq_len

    def last_window(self) -> Window | None:
        """The verdict on the window that ended with the last step (its exchange is still in flight)."""
        return self.stragglers.settle() if self.stragglers is not None else None

    def close(self) -> None:
        self.stop.settle()
        if self.stragglers is not None:
            self.stragglers.settle()
        if self.loader.digests is not None:
            self.loader.digests.close()


class _NoTimer:
    """Straggler detection off: the timed segments cost nothing."""

    @contextlib.contextmanager
    def host(self) -> Any:
        yield

    device = step = host
