"""@smp.step: run a training (or evaluation) step function over microbatches.

Every tensor argument is cut into `microbatches` pieces along dim 0 and the function runs once per
piece. model.backward(loss) scales each microbatch's loss by 1/microbatches, so the gradients are those
of the whole batch's mean loss, and replicas average gradients only after the last microbatch.

With pipeline_parallel_degree > 1 the pieces go through a torch.distributed.pipelining schedule:
- the first stage runs the function until it calls the model, and hands the model's inputs to the
  schedule;
- the last stage's loss function runs the whole function again for that microbatch, with a model that
  returns the stage's output, and gives the schedule the loss passed to model.backward (the schedule's
  scale_grads divides by the microbatch count);
- what the function returned is broadcast from the last stage, so StepOutput holds the same values on
  every rank.
A step runs backward when grad is enabled and the model is in train mode; otherwise forward only.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpkit.compat.smp import step_state, topology
from hpkit.compat.smp.model import DistributedModel, current_model
from hpkit.compat.smp.unsupported import bad_setting

if TYPE_CHECKING:
    pass


class StepOutput:
    """One value the step function returned, per microbatch."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def stack(self) -> torch.Tensor:
        return torch.stack([torch.as_tensor(o) for o in self.outputs])

    def reduce_mean(self) -> torch.Tensor:
        return self.stack().mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        return self.stack().sum(dim=0)

    def concat(self) -> torch.Tensor:
        return torch.cat(self.outputs, dim=0)

    def merge(self) -> Any:
        """The whole batch's value: tensors concatenated along dim 0, also inside tuples, lists, dicts."""
        return _merge(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


def _merge(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values, dim=0) if first.dim() else torch.stack(values)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([v[i] for v in values]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge([v[k] for v in values]) for k in first}
    return values


# ----------------------------------------------------------------------------------------------
# the running step


def split_microbatches(args: tuple, kwargs: dict, n: int) -> list[tuple[tuple, dict]]:
    def split(value: Any, where: str) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % n:
                bad_setting(
                    f"microbatches={n} does not divide the batch dimension ({value.shape[0]}) of the step "
                    f"argument {where}; use a batch size divisible by it (DataLoader drop_last=True)"
                )
            return list(value.tensor_split(n, dim=0))
        return [value] * n

    pieces_args = [split(a, f"#{i}") for i, a in enumerate(args)]
    pieces_kwargs = {k: split(v, k) for k, v in kwargs.items()}
    return [(tuple(p[i] for p in pieces_args), {k: p[i] for k, p in pieces_kwargs.items()}) for i in range(n)]


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _outputs(per_mb: list[Any]) -> Any:
    first = per_mb[0]
    if isinstance(first, tuple):
        return tuple(StepOutput([r[i] for r in per_mb]) for i in range(len(first)))
    if isinstance(first, list):
        return [StepOutput([r[i] for r in per_mb]) for i in range(len(first))]
    if isinstance(first, dict):
        return {k: StepOutput([r[k] for r in per_mb]) for k in first}
    if first is None:
        return None
    return StepOutput(per_mb)


def step(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator (also `@smp.step()`); options such as non_split_inputs are not supported."""
    if options:
        from hpkit.compat.smp.unsupported import stop

        stop(
            f"@smp.step({', '.join(options)}=...)",
            "pass arguments that must not be split as non-tensors, or split them yourself",
        )
    if func is None:
        return step

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        model = current_model()
        if model is None:
            bad_setting("@smp.step ran before smp.DistributedModel(model) was created")
        n = topology.config().microbatches
        pieces = split_microbatches(args, kwargs, n)
        if model.schedule is None:
            per_mb = _run_local(func, model, pieces)
        else:
            per_mb = _run_pipeline(func, model, pieces)
        return _outputs(per_mb)

    return run


def _run_local(
    func: Callable[..., Any], model: DistributedModel, pieces: list[tuple[tuple, dict]]
) -> list[Any]:
    n = len(pieces)
    per_mb = []
    with step_state.running(step_state.RunningStep(n, pipeline=False)):
        for i, (a, k) in enumerate(pieces):
            with model.gradient_sync(i == n - 1):
                per_mb.append(_detach(func(*a, **k)))
    return per_mb


# ----------------------------------------------------------------------------------------------
# pipeline


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _InputCatcher:
    """Stands for the model on the first stage: stops the step function at the model call."""

    def __init__(self, model: DistributedModel) -> None:
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _OutputGiver:
    """Stands for the model on the last stage: the model call returns the stage's output."""

    def __init__(self, model: DistributedModel, output: Any) -> None:
        self._model, self._output = model, output

    def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        return self._output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _swap_model(pieces: tuple[tuple, dict], model: DistributedModel, proxy: Any) -> tuple[tuple, dict]:
    a, k = pieces
    return (
        tuple(proxy if v is model else v for v in a),
        {key: proxy if v is model else v for key, v in k.items()},
    )


@dataclass
class _PipelineRun:
    func: Callable[..., Any]
    model: DistributedModel
    pieces: list[tuple[tuple, dict]]
    train: bool
    # by microbatch: the schedule may call the loss function once more while it sets up (shape inference)
    results: dict[int, Any] = field(default_factory=dict)

    def loss_fn(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        i = int(index.reshape(-1)[0])
        a, k = _swap_model(self.pieces[i], self.model, _OutputGiver(self.model, output))
        state = step_state.RunningStep(len(self.pieces), pipeline=True)
        with step_state.running(state):
            returned = self.func(*a, **k)
        self.results[i] = _detach(returned)
        if not self.train:
            return torch.zeros((), device=output.device if isinstance(output, torch.Tensor) else None)
        if len(state.losses) != 1:
            bad_setting(
                f"an @smp.step function must call model.backward(loss) once per call when training (it called "
                f"it {len(state.losses)} times); for evaluation run the step under torch.no_grad() or model.eval()"
            )
        return state.losses[0]


def _run_pipeline(
    func: Callable[..., Any], model: DistributedModel, pieces: list[tuple[tuple, dict]]
) -> list[Any]:
    st = topology.state()
    pp_rank, pp = st.coords.pp_rank, st.config.pp
    n = len(pieces)
    train = torch.is_grad_enabled() and model.training
    inputs: tuple = ()
    if pp_rank == 0:
        captured = [_capture_inputs(func, model, p) for p in pieces]
        inputs = tuple(torch.cat([c[j] for c in captured], dim=0) for j in range(len(captured[0])))
    run = _PipelineRun(func, model, pieces, train)
    target = torch.arange(n, device=st.device)
    with step_state.pipeline_running(run):
        if train:
            model.schedule.step(*inputs, target=target, losses=[])
        else:
            model.schedule.eval(*inputs, target=target, losses=[])
    if pp_rank == pp - 1:
        mine = [run.results[i] for i in range(n)]
        _send_results(mine, st.device)
        return mine
    return _receive_results(pp - 1, st.device)


def _send_results(results: list[Any], device: torch.device) -> None:
    step_state.finish_sends()
    group = topology.get_pp_process_group()
    payload = pickle.dumps(_encode(results), protocol=pickle.HIGHEST_PROTOCOL)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    src = dist.get_group_rank(group, dist.get_rank())
    for buffer in (size, data):
        work = dist.broadcast(buffer, group=group, group_src=src, async_op=True)
        step_state.pending_sends.append((work, buffer))


def _receive_results(src: int, device: torch.device) -> list[Any]:
    group = topology.get_pp_process_group()
    size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, group=group, group_src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group, group_src=src)
    return _decode(pickle.loads(data.cpu().numpy().tobytes()), device)


@dataclass(frozen=True)
class _Raw:
    """A tensor as bytes: pickling torch tensors goes through their storages and costs ~10x more."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().cpu().reshape(-1)
        return _Raw(value.dtype, tuple(value.shape), flat.view(torch.uint8).numpy().tobytes())
    if isinstance(value, (tuple, list)):
        return type(value)(_encode(v) for v in value)
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, _Raw):
        raw = (
            torch.frombuffer(bytearray(value.data), dtype=torch.uint8)
            if value.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(value.dtype).reshape(value.shape).to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_decode(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _decode(v, device) for k, v in value.items()}
    return value


def _capture_inputs(func: Callable[..., Any], model: DistributedModel, piece: tuple[tuple, dict]) -> tuple:
    a, k = _swap_model(piece, model, _InputCatcher(model))
    try:
        func(*a, **k)
    except _Captured as got:
        if got.kwargs or not all(isinstance(v, torch.Tensor) for v in got.args):
            bad_setting(
                "with pipeline_parallel_degree > 1 the model must be called with tensors as positional "
                "arguments only (a pipeline stage passes on tensors)"
            )
        return got.args
    bad_setting("an @smp.step function must call the model (the DistributedModel passed to it)")
