"""Split a model into pipeline stages by itself: torch.fx traces the forward (no data needed, so the
optimizer can be built before the first step), the modules with parameters are taken in the order the
forward calls them, and cut into contiguous runs with the largest run's parameter count as small as
possible. torch.fx's split_module then makes one GraphModule per stage that holds the very same
submodules under their original names, so state dicts keep the model's keys in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn
from torch.fx.passes.split_module import split_module

from hpkit.compat.smp.unsupported import bad_setting


@dataclass(frozen=True)
class Partition:
    graph: fx.GraphModule  # the traced whole model
    units: list[str]  # modules (or bare parameters) with parameters, in call order
    stage_of: dict[str, int]
    stages: list[fx.GraphModule]


def trace(model: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...) for untraceable code
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        bad_setting(
            "pipeline_parallel_degree > 1 splits the model by tracing its forward with torch.fx, which failed "
            f"({type(exc).__name__}: {reason}); make the forward traceable (no branching on tensor values) "
            "or set pipeline_parallel_degree: 1"
        )


def _param_count(model: nn.Module, target: str) -> int:
    owner = model.get_submodule(target) if target else model
    return sum(p.numel() for p in owner.parameters())


def call_order(gm: fx.GraphModule, model: nn.Module) -> list[tuple[str, int]]:
    """(unit, parameter count) for every module or attribute with parameters, in first-use order."""
    seen: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            count = _param_count(model, node.target)
        elif node.op == "get_attr":
            attr = _get_attr(model, node.target)
            count = attr.numel() if isinstance(attr, nn.Parameter) else 0
        else:
            continue
        if count and node.target not in seen:
            seen[node.target] = count
    return list(seen.items())


def _get_attr(model: nn.Module, target: str) -> object:
    obj: object = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def balance(weights: list[int], parts: int) -> list[int]:
    """Stage index of each weight: contiguous, non-empty parts minimising the largest part's sum."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible largest sum when the first i weights form k parts; cut[k][i]: start of part k.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    stage = [0] * n
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        for idx in range(j, i):
            stage[idx] = k - 1
        i = j
    return stage


def partition(model: nn.Module, pp: int) -> Partition:
    gm = trace(model)
    order = call_order(gm, model)
    if pp > len(order):
        bad_setting(
            f"pipeline_parallel_degree={pp} is larger than the model's {len(order)} modules with parameters "
            f"({', '.join(u for u, _ in order)}); set pipeline_parallel_degree to at most {len(order)}"
        )
    units = [u for u, _ in order]
    stage_of = dict(zip(units, balance([c for _, c in order], pp), strict=True))

    assigned: dict[str, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op in ("call_module", "get_attr") and node.target in stage_of:
            wanted = stage_of[node.target]
            if wanted < current:
                bad_setting(
                    f"pipeline_parallel_degree={pp}: {node.target} (stage {wanted}) is used again after stage "
                    f"{current}'s modules; a module shared across stages cannot be split, set "
                    "pipeline_parallel_degree: 1"
                )
            current = wanted
        assigned[node.name] = current
    split = split_module(gm, model, lambda node: assigned[node.name], keep_original_order=True)
    stages = [getattr(split, f"submod_{i}") for i in range(pp)]
    _check_chain(split, pp)
    return Partition(gm, units, stage_of, stages)


def _check_chain(split: fx.GraphModule, pp: int) -> None:
    """Each stage must take exactly what the stage before it returns, in order: that is all a pipeline
    stage is given."""
    calls = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
    placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
    first = calls["submod_0"]
    if list(first.args) != placeholders or first.kwargs:
        bad_setting(
            f"pipeline_parallel_degree={pp}: the first stage does not take all the model's inputs in order; "
            "a later stage uses a model input directly, which a pipeline cannot pass on; set pipeline_parallel_degree: 1"
        )
    for i in range(1, pp):
        prev, node = calls[f"submod_{i - 1}"], calls[f"submod_{i}"]
        users = [u for u in prev.users if u.op == "call_function"]
        expected = [prev] if not users else sorted(users, key=lambda u: u.args[1])
        whole = not users or [u.args[1] for u in expected] == list(range(len(expected)))
        if list(node.args) != expected or node.kwargs or not whole:
            bad_setting(
                f"pipeline_parallel_degree={pp}: stage {i} needs values that stage {i - 1} does not return "
                "(a skip connection across stages); set a smaller pipeline_parallel_degree"
            )
    (out,) = [n for n in split.graph.nodes if n.op == "output"]
    if out.args[0] is not calls[f"submod_{pp - 1}"]:
        bad_setting(
            f"pipeline_parallel_degree={pp}: the model's output is not simply the last stage's output; "
            "set pipeline_parallel_degree: 1"
        )
