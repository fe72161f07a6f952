"""`hpkit train`'s run: join the process group, build the Trainer, resume, loop, save, summarise.

The loop is a short sequence of named steps; what each does lives in the Trainer (a step), the
Checkpointer (when to save, how to resume) and the metrics (what to record).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from hpkit.errors import SpecError
from hpkit.job_events import done_line, stopping_line
from hpkit.metrics.records import CheckpointEvent, EndEvent, StartEvent
from hpkit.runtime.checkpoints.checkpoint import Checkpointer
from hpkit.runtime.checkpoints.checkpoint_record import CommitRecord, step_dir_name, step_of
from hpkit.runtime.checkpoints.memory_checkpoint import MemoryCheckpointer
from hpkit.runtime.checkpoints.memory_layout import memory_root, run_key
from hpkit.runtime.config import RunConfig
from hpkit.runtime.env import DeviceInfo, LaunchEnv, distributed, node_name
from hpkit.runtime.loop.evaluate import Evaluator
from hpkit.runtime.loop.trainer import StepResult, Trainer
from hpkit.runtime.observe.metrics import MetricsLogger, peak_tflops
from hpkit.runtime.observe.report import StepReporter
from hpkit.runtime.parallel.collectives import decide
from hpkit.runtime.run_identity import RunIdentity, RunPaths, run_paths, sweep_overrides
from hpkit.runtime.stay import leave_if_step_ended, may_stay, ranks_that_stayed, survivors_stay, why_leaving
from hpkit.runtime.stay import offer as offer_to_stay
from hpkit.runtime.watchdog import faults
from hpkit.runtime.watchdog.hang_watchdog import HangWatchdog, enable_flight_recorder
from hpkit.supervise.ready import announce as announce_ready
from hpkit.warm import park

if TYPE_CHECKING:
    from hpkit.runtime.observe.prometheus import PrometheusExporter

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The parts of a start-up, in order, whose end rank 0 records in its start record (StartEvent.phases, Unix
# seconds): the process created, hpkit and torch imported (run() entered), the process group joined, the
# model built, the in-memory tier's group set up, the state restored. A restart's seconds are told apart
# from these (bench/bench_recovery.py), with the supervisor's events before them.
START_PHASES = ("process", "imported", "group", "trainer", "memory", "restored")


def run(cfg: RunConfig) -> int:
    # A process that stayed from an earlier step (hpkit.warm.park) began this run when that step took it over.
    phases = {"process": park.adopted_at or _process_started(), "imported": time.time()}
    quiet_known_warnings()
    if cfg.resilience.hang.enabled:
        # The watchdog compares each rank's newest collectives from the flight recorder, which must be on
        # before the process groups are made.
        enable_flight_recorder()
    # A collective stuck on a dead peer fails after this long instead of hanging the job.
    with distributed(
        timeout_s=cfg.resilience.collective_timeout_s,
        choose_backend=lambda launch, device: choose_collectives(cfg, launch, device),
        abort_on_error=may_stay(cfg),
    ) as d:
        phases["group"] = time.time()
        offer_to_stay(cfg)
        return _train(cfg, d.launch, d.device, phases)


def _process_started() -> float:
    """When this process was created (Unix seconds), from /proc: the interpreter's own start-up and imports
    come after it. The moment of the call where /proc cannot say."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time after boot, in ticks
        # Against the boot clock itself: /proc/stat's btime is whole seconds, up to 1 s off.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _train(
    cfg: RunConfig, launch: LaunchEnv, device: DeviceInfo, phases: dict[str, float] | None = None
) -> int:
    run = _set_up(cfg, launch, device, {} if phases is None else phases)
    resumed = _restore(run)
    # Built before the first step, so that a held-out set that cannot be read stops the run at once.
    evaluator = Evaluator(run.trainer, cfg.eval) if cfg.eval is not None else None
    if evaluator is not None and evaluator.spec.only:
        return _validate_only_then_close(run, evaluator, resumed is not None)
    _record_start(run, resumed)
    summary = Throughput(first_step=run.trainer.step + 1, last_step=cfg.train.steps)
    _arm_watchdog(run, evaluator)
    run.fault = faults.from_env()
    last = _loop_then_close(run, evaluator, summary)
    if last is None:
        run.say(f"hpkit train: nothing to do: already at step {run.trainer.step} of {cfg.train.steps}")
        return 0
    run.say(summary.line(last, run.trainer, launch, device, run.peak))
    return 128 + run.trainer.stop_signal if run.trainer.stop_requested else 0


@dataclasses.dataclass
class _Run:
    """What a run holds from set-up to its summary line; the steps of `_train` below share it."""

    cfg: RunConfig
    launch: LaunchEnv
    say: Callable[[str], None]
    paths: RunPaths
    metrics: MetricsLogger
    trainer: Trainer
    peak: float | None
    report: StepReporter
    phase: WatchdogPhase
    checkpointer: Checkpointer | None
    memory: MemoryCheckpointer | None  # None once closed, so that the last `finally` does not close it again
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # START_PHASES reached, Unix seconds
    watchdog: HangWatchdog | None = None
    fault: faults.Fault | None = None


def _set_up(cfg: RunConfig, launch: LaunchEnv, device: DeviceInfo, phases: dict[str, float]) -> _Run:
    """The trainer, the metrics, the checkpointers and the reporter; the banner printed."""
    say = _printer(launch.rank == 0)
    identity = RunIdentity.from_env()
    paths = run_paths(cfg, identity)  # the same answer `hpkit status|plot` finds from outside (job_files)
    metrics = _metrics_logger(cfg, launch.rank == 0, paths)
    trainer = Trainer(cfg, device)
    phases["trainer"] = time.time()
    peak = peak_tflops(device.name, device.type, trainer.mixed_precision)
    report = StepReporter(trainer, metrics, _exporter(cfg, launch, identity), peak, say)
    phase = WatchdogPhase()
    checkpointer = _checkpointer(
        cfg, launch.rank, trainer, say, metrics, paths.checkpoint_dir, saving=lambda: phase("save")
    )
    memory = _memory_checkpointer(cfg, paths, identity, say, trainer)
    phases["memory"] = time.time()
    say(_banner(cfg, launch, device, trainer))
    if memory is not None:
        say(f"hpkit train: {memory.describe()}")
    return _Run(cfg, launch, say, paths, metrics, trainer, peak, report, phase, checkpointer, memory, phases)


def _restore(run: _Run) -> str | None:
    """The run's own checkpoint when there is one (checkpoint.resume), then init_from's weights where they
    still apply; what it resumed from, or None."""
    cfg, trainer, memory = run.cfg, run.trainer, run.memory
    resumed = _resume(cfg, trainer, run.checkpointer, memory) if cfg.checkpoint.resume else None
    if memory is not None:
        memory.forget_after(trainer.step)
    run.phases["restored"] = time.time()
    if resumed is not None:
        run.say(f"hpkit train: resumed from {resumed} at step {trainer.step}")
    if trainer.hf is not None and (resumed is None or cfg.model.lora is not None):
        # A checkpoint of this run (above) takes precedence: it holds the weights trained since. A LoRA
        # checkpoint holds only the adapters: the frozen base it was trained on is still init_from's.
        loaded = trainer.load_pretrained()
        run.say(
            f"hpkit train: loaded {loaded.tensors} tensors from {cfg.model.init_from} "
            f"(rank 0 read {loaded.bytes_read / 2**20:.1f} MiB)"
        )
    return resumed


def _validate_only_then_close(run: _Run, evaluator: Evaluator, resumed: bool) -> int:
    try:
        return _validate_only(run.cfg, run.trainer, evaluator, run.report, resumed, run.say)
    finally:
        if run.checkpointer is not None:
            run.checkpointer.close()
        if run.memory is not None:
            run.memory.close(completed=False)
        run.trainer.close()
        run.report.close()


def _record_start(run: _Run, resumed: str | None) -> None:
    # `hpkit status` and `hpkit plot` read runs, restarts and the step total from these records.
    stayed = ranks_that_stayed() if survivors_stay(run.cfg) else None
    run.metrics.event(
        StartEvent(
            run.trainer.step,
            total_steps=run.cfg.train.steps,
            restart=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            resumed_from=str(resumed) if resumed is not None else None,
            world_size=run.launch.world_size,
            overrides=sweep_overrides(),
            phases=run.phases or None,
            stayed=stayed,
        )
    )


def _arm_watchdog(run: _Run, evaluator: Evaluator | None) -> None:
    run.watchdog = run.phase.watchdog = _watchdog(run.cfg, run.launch, run.paths)
    if run.watchdog is not None and evaluator is not None:
        run.watchdog.eval_rounds = len(evaluator.rounds)


def _loop_then_close(run: _Run, evaluator: Evaluator | None, summary: Throughput) -> StepResult | None:
    """The steps, the final save and the end record; whatever happens, the watchdog, trainer and reporter
    are closed. The last step's result (None: no step ran)."""
    trainer = run.trainer
    last: StepResult | None = None
    try:
        with _stop_on_signals(trainer.request_stop, may_stay(run.cfg)):
            # The job's supervisor holds a USR1 until every rank's handler is in place (it would kill the rank).
            announce_ready(os.environ, run.launch.rank, run.launch.world_size)
            last = _loop(run, evaluator, summary)
            _after_loop(run, last)
        _release_memory(run)
        run.metrics.event(
            EndEvent(
                trainer.step,
                total_steps=run.cfg.train.steps,
                stopped_by_signal=trainer.stop_signal if trainer.stop_requested else None,
            )
        )
    finally:
        if run.watchdog is not None:
            run.watchdog.stop()
        if run.memory is not None:
            run.memory.close(completed=False)
        trainer.close()
        run.report.close()
    return last


def _loop(run: _Run, evaluator: Evaluator | None, summary: Throughput) -> StepResult | None:
    """Steps until the last one, or until a signal asks the run to stop."""
    last: StepResult | None = None
    while run.trainer.step < run.cfg.train.steps:
        leave_if_step_ended()  # resilience.keep_survivors
        last = _step(run, evaluator, summary)
        if run.trainer.stop_requested:
            run.say(stopping_line(run.trainer.step, run.trainer.stop_signal))
            break
    return last


def _step(run: _Run, evaluator: Evaluator | None, summary: Throughput) -> StepResult:
    """One step, timed, checked, validated and saved when due, and reported."""
    trainer, fault = run.trainer, run.fault
    if fault is not None:
        fault.before_step(run.launch.rank, trainer.step + 1)
    last = trainer.train_step(run.checkpointer, run.memory)
    if run.watchdog is not None:
        run.watchdog.step_done(last.step, last.step_time_s)
    summary.add(last, trainer.tokens_per_step)
    if last.logged:
        _check_finite(last)
    evaluation = None
    if evaluator is not None and evaluator.due(last.step) and not trainer.stop_requested:
        # A phase of its own for the hang watchdog: a long held-out set is no hang, but a rank
        # stuck in it is named once the validation outlasts its own length (hang_rules), not
        # at the collective timeout as in a save.
        with run.phase("eval"):
            if fault is not None:
                fault.before_eval(run.launch.rank, last.step)
            evaluation = evaluator.run()
    run.report.step(last, evaluation)
    if run.checkpointer is not None:
        _save(run, last.step, forced=trainer.stop_requested)
    if run.memory is not None:
        with run.phase("save"):
            run.memory.save(last.step, trainer.checkpoint_state())
    return last


def _save(run: _Run, step: int, *, final: bool = False, forced: bool = False) -> None:
    checkpointer = run.checkpointer
    assert checkpointer is not None
    if not checkpointer.due(step, final=final, forced=forced):
        return
    with run.phase("save"):  # every save, the final one included, is judged as a save
        if run.fault is not None:
            run.fault.before_save(run.launch.rank, step)
        checkpointer.save(step, run.trainer.checkpoint_state(), final=final, forced=forced)


def _after_loop(run: _Run, last: StepResult | None) -> None:
    """The last window's report, the final save and the wait for the async saves."""
    if (window := run.trainer.last_window()) is not None:
        run.report.window(window)
    if run.checkpointer is not None:
        # The final save and the wait for the last async save's upload block on I/O like any
        # save: judged as one, or a save slower than the hang threshold is called a hang.
        with run.phase("save"):
            if last is not None and not run.trainer.stop_requested:
                _save(run, last.step, final=True)
            run.checkpointer.close()


def _release_memory(run: _Run) -> None:
    if run.memory is not None:
        with run.phase("save"):
            # A run that reached its last step frees its nodes' memory; one stopped by a signal keeps
            # it for the restart (a requeue onto the same nodes resumes from it).
            run.memory.close(completed=not run.trainer.stop_requested)
        run.memory = None


def _validate_only(
    cfg: RunConfig,
    trainer: Trainer,
    evaluator: Evaluator,
    report: StepReporter,
    resumed: bool,
    say: Callable[[str], None],
) -> int:
    """eval.only: one validation of the loaded weights, printed and recorded; no step, no save."""
    if not resumed and trainer.hf is None:
        raise SpecError(
            f"eval.only: no checkpoint to validate in checkpoint.dir ({cfg.checkpoint.dir}) and no "
            "model.init_from: point checkpoint.dir at a run's checkpoints (with checkpoint.resume: true)"
        )
    result = evaluator.run()
    report.evaluation(result, only=True)
    weights = "checkpoint" if resumed else f"init_from {cfg.model.init_from}"
    say(f"hpkit train: eval only: step {result.step} ({weights}) | {result.line()}")
    return 0


# --------------------------------------------------------------------------------------------------
# The pieces of a run


@dataclasses.dataclass
class Throughput:
    """Tokens and seconds over the timed steps: the first step pays for allocation, compile and
    communicator set-up, so it is left out (unless it is the only one)."""

    first_step: int
    last_step: int
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0

    def add(self, result: StepResult, tokens: int) -> None:
        if result.step > self.first_step or self.last_step == self.first_step:
            self.tokens += tokens
            self.seconds += result.step_time_s
            self.steps += 1

    def line(
        self, last: StepResult, trainer: Trainer, launch: LaunchEnv, device: DeviceInfo, peak: float | None
    ) -> str:
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        tflops = trainer.flops_per_token * tps / launch.world_size / 1e12
        mfu = f"{tflops / peak * 100:.1f}%" if peak else "n/a"
        layout = ",".join(f"{k}:{v}" for k, v in trainer.dims.degrees().items() if v > 1) or "single"
        loss = f"{last.loss:.4f}" if last.loss is not None else "n/a"
        return done_line(
            {
                "steps": str(last.step),
                "final_loss": loss,
                "tokens_per_s": f"{tps:.0f}",
                "tflops_per_device": f"{tflops:.3f}",
                "mfu": mfu,
                "step_ms": f"{self.seconds / max(1, self.steps) * 1000:.0f}",
                "world": str(launch.world_size),
                "layout": layout,
                "device": device.type,
            }
        )


class WatchdogPhase:
    """`with watchdog_phase("save"):` has the hang watchdog judge the body as that phase (a save is long by
    design), then puts back the phase around it ("step" outside every one: the watchdog's clock restarts).
    Nests, so the Checkpointer can mark its own blocking waits inside a save the loop marked. Does nothing
    while `watchdog` is None (no watchdog, or not started yet)."""

    def __init__(self) -> None:
        self.watchdog: HangWatchdog | None = None
        self._stack: list[str] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        watchdog = self.watchdog
        outer = self._stack[-1] if self._stack else "step"
        self._stack.append(name)
        if watchdog is not None and name != outer:
            watchdog.phase(name)
        try:
            yield
        finally:
            self._stack.pop()
            if watchdog is not None and name != outer:
                watchdog.phase(outer)


def _watchdog(cfg: RunConfig, launch: LaunchEnv, paths: RunPaths) -> HangWatchdog | None:
    """The hang watchdog, started after the resume so that the first step's clock holds the start-up."""
    hang = cfg.resilience.hang
    if not hang.enabled or paths.hangs_dir is None:
        return None
    return HangWatchdog(
        paths.hangs_dir,
        launch.rank,
        launch.world_size,
        hang.min_s,
        hang.factor,
        hang.start_s,
    ).start()


def _printer(enabled: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if enabled:
            print(line, flush=True)

    return say


def _metrics_logger(cfg: RunConfig, enabled: bool, paths: RunPaths) -> MetricsLogger:
    tensorboard = paths.tensorboard_dir if cfg.train.tensorboard else None
    return MetricsLogger(enabled=enabled, jsonl_path=paths.metrics_file, tensorboard_dir=tensorboard)


def _exporter(cfg: RunConfig, launch: LaunchEnv, identity: RunIdentity) -> PrometheusExporter | None:
    if cfg.train.prometheus is None:
        return None
    # Imported only when asked for: the images install torch and hpkit, not every package of the extra.
    try:
        from hpkit.runtime.observe.prometheus import PrometheusExporter
    except ImportError:
        raise SpecError(
            "train.prometheus needs prometheus-client, which is not installed here: "
            "pip install prometheus-client (the train extra has it), or remove train.prometheus"
        ) from None

    return PrometheusExporter(
        cfg.train.prometheus, cfg.name, identity.run_id, launch.rank, launch.local_rank, node_name()
    )


def _checkpointer(
    cfg: RunConfig,
    rank: int,
    trainer: Trainer,
    say: Callable[[str], None],
    metrics: MetricsLogger,
    root: Path | None,
    saving: Callable[[], AbstractContextManager[None]],
) -> Checkpointer | None:
    if root is None:
        return None

    def committed(record: CommitRecord, path: Path) -> None:
        metrics.event(CheckpointEvent(record.step, path=str(path)))

    return Checkpointer(
        cfg.checkpoint,
        root,
        rank,
        layout=trainer.dims.degrees(),
        log=say,
        on_commit=committed,
        model=trainer.model_record(),
        saving=saving,
        refusal=trainer.checkpoint_refusal,
    )


def _memory_checkpointer(
    cfg: RunConfig, paths: RunPaths, identity: RunIdentity, say: Callable[[str], None], trainer: Trainer
) -> MemoryCheckpointer | None:
    spec = cfg.checkpoint.memory
    if spec is None:
        return None
    anchor = paths.checkpoint_dir or paths.metrics_file
    root = memory_root() / run_key(anchor, identity.run_id)
    persistent = paths.checkpoint_dir is not None
    return MemoryCheckpointer(
        spec, root, node_name(), log=say, rack=_rack(), persistent=persistent, asking=trainer.cpu_group
    )


def _rack() -> str | None:
    """The switch above this node in Slurm's topology (SLURM_TOPOLOGY_ADDR: "spine.leaf.node"): partner
    copies go to another rack where the topology names racks."""
    address = os.environ.get("SLURM_TOPOLOGY_ADDR", "")
    return address.rsplit(".", 1)[0] if "." in address else None


def _resume(
    cfg: RunConfig, trainer: Trainer, checkpointer: Checkpointer | None, memory: MemoryCheckpointer | None
) -> str | None:
    """From memory when it holds a step newer than checkpoint.dir's newest (it reads nothing from there),
    else from checkpoint.dir; the name of what was loaded, or None."""
    dirty = False
    if memory is not None:
        # Rank 0's view of checkpoint.dir decides (memory.restore gathers it): one read of the shared
        # filesystem per restart, not one per rank.
        latest = checkpointer.latest() if checkpointer is not None and memory.rank == 0 else None
        step = memory.restore(trainer.checkpoint_state(), newer_than=step_of(latest) if latest else None)
        if step is not None:
            return f"memory:{step_dir_name(step)}"
        dirty = memory.dirty  # a load that failed part-way: what it wrote must not stay
    path = trainer.resume(checkpointer) if checkpointer is not None else None
    if path is None and dirty:
        trainer.reset()
    return str(path) if path is not None else None


def _banner(cfg: RunConfig, launch: LaunchEnv, device: DeviceInfo, trainer: Trainer) -> str:
    work = f"{cfg.train.steps} steps of {trainer.tokens_per_step} tokens"
    if cfg.eval is not None and cfg.eval.only:
        work = "validation only (eval.only)"
    return (
        f"hpkit train: {cfg.name}: model {cfg.model.init_from or cfg.model.name} ({trainer.adapter.num_params(trainer.model_cfg) / 1e6:.2f}M params), "
        f"{trainer.dims.describe()} on {launch.world_size} {device.type} rank(s) ({device.backend}, "
        f"launched by {launch.source}), {work}"
    )


def _check_finite(result: StepResult) -> None:
    if result.loss is not None and not math.isfinite(result.loss):
        raise SpecError(f"the loss became {result.loss} at step {result.step}: lower train.lr")


@contextmanager
def _stop_on_signals(request_stop: Callable[[int], None], may_stay: bool = False) -> Iterator[None]:
    """Slurm sends SIGTERM (or the --signal one) before killing: finish the step, save, then stop.

    `may_stay` (resilience.keep_survivors): where the run ends because its group broke, the stop signals are
    ignored from then on instead of their defaults restored. The launcher saw the same failure and stops its
    ranks (torchrun's agent sends SIGTERM within milliseconds); this rank is leaving to stay for the next step
    (hpkit.runtime.stay), and a default action would kill it on the way."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: request_stop(signum))
    try:
        yield
    except Exception as exc:
        if may_stay and why_leaving(exc):
            previous = dict.fromkeys((*STOP_SIGNALS, signal.SIGINT, signal.SIGHUP), signal.SIG_IGN)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def choose_collectives(cfg: RunConfig, launch: LaunchEnv, device: DeviceInfo) -> DeviceInfo:
    """On GPUs, SMDDP instead of NCCL where the spec asks for it and it can run (else why not, in one line)."""
    if device.type != "cuda":
        return device
    choice = decide(cfg.collectives.backend, cfg.collectives.smddp_fallback, cfg.instance_type)
    if launch.rank == 0 and cfg.collectives.backend != "auto":
        print(f"hpkit train: {choice.reason}", flush=True)
    if not choice.usable:
        raise SpecError(choice.reason)
    return dataclasses.replace(device, backend=choice.backend)


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
