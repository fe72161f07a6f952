"""What `hpkit plan` is asked, resolved into what the search takes, and the search's verdict when nothing fits.

`PlanAsk` is the question in typed fields (no argparse: the command turns its flags into one); `resolve` turns it
into a `PlanProblem` (the model's shape, the hardware, the world, the global batch); `rank` runs the search and
turns an empty ranking into one line. The error messages name the command's flags, which is what a user typed.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpkit.errors import SpecError
from hpkit.plan.search import SearchResult, search
from hpkit.slurm.options import MAX_NODES

if TYPE_CHECKING:
    from hpkit.models.llama.shape import ModelShape
    from hpkit.plan.speed import Hardware
    from hpkit.spec import JobSpec

DEFAULT_SEQ = 8192


@dataclass(frozen=True)
class PlanAsk:
    """The question: a model on NODES x INSTANCE, with the batch, sequence and precision given (None: default)."""

    target: str  # as the user named it: a shape, a config.json folder, a model: file, or a job spec
    nodes: int | None = None
    instance: str | None = None
    seq: int | None = None
    global_batch: int | None = None
    global_tokens: int | None = None
    precision: str | None = None
    network: str | None = None  # a pairs JSON whose measured bandwidth replaces the catalog's
    model: Any = None  # a model: block (a file holding one), checked here
    base: JobSpec | None = None  # the job spec whose ranks per node the trial jobs run
    spec_mode: bool = False  # base is the target itself: the search is over its model, world and batch


@dataclass(frozen=True)
class PlanProblem:
    """The question resolved: what the search runs over."""

    target: str
    nodes: int
    instance: str
    shape: ModelShape
    hw: Hardware
    gpu_gib: float
    seq: int
    global_batch: int
    precision: str
    model: dict[str, Any] | None  # the model: block (its seq_len set), None for a shape name or a folder
    memory_checkpoint: Any = None  # a spec's checkpoint.memory, in spec mode

    @property
    def world(self) -> int:
        return self.nodes * self.hw.gpus_per_node


@dataclass(frozen=True)
class _Model:
    shape: ModelShape
    seq: int
    block: dict[str, Any] | None
    precision: str | None = None  # the spec's own, in spec mode
    spec_batch: int | None = None  # the spec's global batch scaled to the asked nodes, in spec mode


def resolve(ask: PlanAsk) -> PlanProblem:
    """The shape, hardware, world and global batch for an ask; each missing or wrong input as one line."""
    nodes, instance = ask.nodes, ask.instance
    if ask.spec_mode:
        assert ask.base is not None
        nodes = nodes or ask.base.job.nodes
        instance = instance or ask.base.job.instance_type
        if not instance:
            raise SpecError(f"{ask.target}: instance_type: missing: set it in the spec, or give --instance")
    if nodes is None:
        raise SpecError("--nodes: missing: how many nodes the job runs on")
    if nodes > MAX_NODES:
        raise SpecError(f"--nodes: {nodes} is more than any cluster holds: give at most {MAX_NODES:,}")
    model = _model(ask, nodes)
    precision = ask.precision or model.precision or "bf16"
    hw, gpu_gib = hardware(instance, precision, ask.network)
    if ask.base is not None:
        # The trial jobs run the base's ranks per node (tasks_per_node, or gpus_per_node): so does the search.
        hw = replace(hw, gpus_per_node=ask.base.job.ranks_per_node)
    assert instance is not None  # hardware() refused a missing one
    return PlanProblem(
        target=ask.target,
        nodes=nodes,
        instance=instance,
        shape=model.shape,
        hw=hw,
        gpu_gib=gpu_gib,
        seq=model.seq,
        global_batch=_global_batch(ask, model, nodes * hw.gpus_per_node),
        precision=precision,
        model=model.block,
        memory_checkpoint=ask.base.run.checkpoint.memory if ask.spec_mode and ask.base is not None else None,
    )


def rank(problem: PlanProblem) -> SearchResult:
    """The search over the problem's layouts; no layout that fits is an error naming the closest miss."""
    p = problem
    result = search(
        p.shape, p.hw, p.nodes, p.global_batch, p.precision, p.instance, p.gpu_gib, p.memory_checkpoint
    )
    if not result.ranked:
        miss = result.closest_miss()
        if miss is not None:
            raise SpecError(
                f"model {p.target}: fits no layout on {p.nodes} x {p.hw.name}: the closest, "
                f"{miss.layout.describe()}, {miss.problem}: add nodes, or lower --seq/--global-batch"
            )
        first = result.rejected[0].problem if result.rejected else "no layout divides the world"
        raise SpecError(f"model {p.target}: no layout the runtime accepts on {p.world} GPUs: {first}")
    return result


def _model(ask: PlanAsk, nodes: int) -> _Model:
    """The shape and seq from the spec (spec mode), a model: block, or a shape name / config.json folder."""
    from hpkit.plan.shapes import resolve_model, shape_of_spec

    if ask.spec_mode:
        from hpkit.plan.layout import Layout

        base = ask.base
        assert base is not None
        job, run = base.job, base.run
        device = "cuda" if job.gpus_per_node else "cpu"
        spec_layout = Layout.from_run_config(run, world=job.world_size, device_type=device)
        seq = ask.seq or run.model.seq_len
        block = run.model.model_dump(mode="json", exclude_defaults=True)
        block["seq_len"] = seq
        return _Model(
            shape=replace(shape_of_spec(run.model), seq_len=seq),
            seq=seq,
            block=block,
            precision=ask.precision or spec_layout.precision,
            spec_batch=spec_layout.global_batch * nodes // job.nodes,
        )
    if ask.model is not None:
        from hpkit.runtime.config import ModelSpec
        from hpkit.validation import parse_document

        if not isinstance(ask.model, dict):
            raise SpecError(
                f"{ask.target}: model: a mapping of the spec's model fields (name, dim, moe, ...)"
            )
        block = dict(ask.model)
        block["seq_len"] = ask.seq or block.get("seq_len") or DEFAULT_SEQ
        spec_model = parse_document(ModelSpec, block, ask.target)
        return _Model(shape=shape_of_spec(spec_model), seq=spec_model.seq_len, block=block)
    seq = ask.seq or DEFAULT_SEQ
    return _Model(shape=resolve_model(ask.target, seq), seq=seq, block=None)


def _global_batch(ask: PlanAsk, model: _Model, world: int) -> int:
    if ask.global_tokens is not None:
        if ask.global_tokens % model.seq:
            raise SpecError(f"--global-tokens {ask.global_tokens}: not a multiple of --seq {model.seq}")
        return ask.global_tokens // model.seq
    return ask.global_batch or model.spec_batch or world


def hardware(instance: str | None, precision: str, network: str | None) -> tuple[Hardware, float]:
    """The planner's hardware for an instance type (with a measured inter-node bandwidth when given a pairs
    JSON), and a GPU's memory in GiB."""
    from hpkit import catalog
    from hpkit.plan.speed import hardware_for

    if not instance:
        raise SpecError("--instance: missing: name the nodes' instance type (p5.48xlarge)")
    known = sorted(name for name in catalog.LINKS)
    row = catalog.lookup(instance)
    if row is None or catalog.links(instance) is None:
        raise SpecError(
            f"--instance {instance}: unknown to the planner's catalog: choose one of {', '.join(known)}"
        )
    inter = inter_node_gbs(network) if network else None
    return hardware_for(instance, precision, inter), float(row.gpu_memory_gib)


def inter_node_gbs(path: str) -> float:
    """The median over nodes of each node's best pair busbw (GB/s) in a pairs JSON (hpkit.netbench.pairs's
    best_per_node rule; that module imports torch, which a login node's plan does not)."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise SpecError(f"--network {path}: unreadable: {exc}") from None
    best: dict[str, float] = {}
    for round_ in document.get("rounds", []) if isinstance(document, dict) else []:
        for entry in round_ if isinstance(round_, list) else []:
            value = entry.get("busbw_gbps") if isinstance(entry, dict) else None
            if not isinstance(value, (int, float)) or entry.get("wrong"):
                continue
            for node in entry.get("nodes", []):
                best[node] = max(best.get(node, 0.0), float(value))
    if not best:
        raise SpecError(
            f"--network {path}: no node has a bandwidth figure: give the pairs JSON of a --bandwidth run"
        )
    return float(statistics.median(best.values()))
