"""Expected goodput of a training job under node faults: persistent checkpoints only, or with in-memory recovery.

A first-order model (Young 1974, Daly 2006): faults arrive at a constant rate per node, one at a time. Each costs
detection + restart (spare in place, processes started, rendezvous) + restoring the state + the work since the
last checkpoint (half an interval on average); each checkpoint blocks training for its cost C. So, per unit
time, goodput G = 1 - C / interval - (loss per fault) / MTBF, and Young/Daly's optimum interval is
sqrt(2 x C x MTBF). The optimum is also found by a search over whole steps (intervals are steps in the spec:
`checkpoint.interval`, `checkpoint.memory.every`), which checks the closed form and takes the terms it leaves out
(the in-memory path's fallback to the persistent checkpoint).

Torch-free: `hpkit plan --goodput` runs on a login node. The inputs' defaults and their sources are in
`GoodputInputs`; BENCHMARKS.md ("Goodput at scale") prints the table they give.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from hpkit.errors import SpecError

HOUR = 3600.0
GB = 1e9  # decimal, as file system and link rates are quoted
# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days of pre-training on 16,384
# H100s (2,048 nodes of 8): 1.58e-4 a node-hour, a fault every 3.1 h on the whole job.
LLAMA3_FAULTS_PER_NODE_HOUR = 419 / (54 * 24 * 2048)
SCALES_GPUS = (1024, 4096, 16384)
TARGET_GOODPUT = 0.97  # issue 44: with in-memory recovery, at 16k GPUs, a fault every 3 h
TARGET_MTBF_H = 3.0
TARGET_GPUS = 16384
# The search's longest interval: a week. With in-memory recovery the persistent checkpoint is only the rare
# fallback's, and its optimum can exceed any run; the table then shows this bound.
MAX_INTERVAL_S = 7 * 24 * HOUR


@dataclass(frozen=True)
class GoodputInputs:
    """The model's inputs. Each field is the `hpkit plan --goodput` flag of the same name (`fault_rate` is
    `--fault-rate`); None means "derived from the other fields" (the rule is in the property of the same role)."""

    # Unexpected interruptions per node per hour: Llama 3's (above).
    fault_rate: float = LLAMA3_FAULTS_PER_NODE_HOUR
    gpus_per_node: int = 8  # p5.48xlarge
    # Checkpoint state of the whole job: a 70B model's fp32 weights and AdamW's two fp32 moments, 12 bytes a
    # parameter (issue 44's example); `hpkit plan 70B --goodput` takes the shape's own parameter count.
    state_bytes: float = 70e9 * 12
    # Aggregate FSx for Lustre throughput, read and write, GB/s: PERSISTENT_2 at its highest tier (1,000 MB/s a
    # TiB) on 100,800 GiB, the largest file system HyperPod's FSxLustreConfig creates (98.4 TiB). An assumption:
    # a smaller file system scales it down in proportion; reads from the servers' cache can go faster.
    fs_read_gbs: float = 98.4
    fs_write_gbs: float = 98.4
    # One node's own share, GB/s: 100 Gb/s, an assumed client limit (ENA, no EFA for Lustre). It binds only at
    # small node counts (the per-node share of the state is state_bytes / nodes).
    node_fs_gbs: float = 12.5
    # hpkit's save against dd of the same bytes (BENCHMARKS.md, "DCP save throughput / dd": 0.91).
    save_efficiency: float = 0.91
    # Seconds a persistent checkpoint blocks training (None: state / write rate, as a synchronous save).
    ckpt_write_s: float | None = None
    # Seconds to read the state back from the file system after a fault (None: state / read rate, every node
    # at once, each bound by its own share too).
    restore_s: float | None = None
    # Measured on the local cluster (docs/local-cluster.md "A cut link", BENCHMARKS "The local cluster at scale"): cut -> node
    # named in 7 s -> spare in place at 12 s -> next step at 49-60 s, almost all of it processes starting again.
    detection_s: float = 7.0
    restart_s: float = 53.0  # 60 - 7: the slower run, from the verdict to the next step
    # Restart before an in-memory restore (None: restart_s; today every process starts again. The lead's
    # measurement replaces it).
    memory_restart_s: float | None = None
    step_s: float = 5.0  # seconds a training step takes (an assumption; intervals are whole steps)
    # What one in-memory copy costs training, as a fraction of a step: 5 % (issue 44's budget, an assumption; it is
    # what `every: auto` aims at). On one H200 a warm save cost 0.25-0.76 s of training at 1.5 GiB of state a rank
    # (125M) and 0.7-0.9 s at 16.75 GiB (1B), much of it the one slow step after the save (BENCHMARKS.md, the second
    # and third H200 leases); a 70B state over 16,384 GPUs is ~51 MB a rank, not measured.
    copy_cost: float = 0.05
    # The rate one node pulls its lost state from its partner at: EFA, 3,200 Gb/s a p5 node.
    link_gbps: float = 3200.0
    # Share of faults in-memory recovery cannot serve whatever the partners (every node's RAM lost at once).
    unrecoverable: float = 0.0
    # Fixed intervals in steps, as `checkpoint.interval` and `checkpoint.memory.every` (None: the best ones).
    ckpt_interval: int | None = None
    memory_every: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise SpecError(f"{flag} {value!r}: not a number")
            if f.name == "unrecoverable":
                if not 0 <= value <= 1:
                    raise SpecError(f"{flag} {value:g}: a fraction of the faults, from 0 to 1")
            elif f.name in ("copy_cost", "save_efficiency"):
                if not 0 < value <= 1:
                    raise SpecError(f"{flag} {value:g}: a fraction, greater than 0 and at most 1")
            elif f.name in ("detection_s", "restart_s", "memory_restart_s", "restore_s") and value == 0:
                continue  # a cost of nothing is a legitimate what-if
            elif value <= 0:
                raise SpecError(f"{flag} {value:g}: must be greater than 0")
        for name in ("gpus_per_node", "ckpt_interval", "memory_every"):
            value = getattr(self, name)
            if value is not None and value != int(value):
                raise SpecError(f"--{name.replace('_', '-')} {value:g}: a whole number")

    def checkpoint_s(self, nodes: int) -> float:
        """Seconds a persistent checkpoint blocks training: the state through the file system's aggregate rate,
        or each node's share through its own, whichever is slower."""
        if self.ckpt_write_s is not None:
            return self.ckpt_write_s
        rate = min(self.fs_write_gbs, self.node_fs_gbs * nodes) * GB * self.save_efficiency
        return self.state_bytes / rate

    def fs_restore_s(self, nodes: int) -> float:
        if self.restore_s is not None:
            return self.restore_s
        return self.state_bytes / (min(self.fs_read_gbs, self.node_fs_gbs * nodes) * GB)

    def peer_restore_s(self, nodes: int) -> float:
        """The replacement node pulls its node's share of the state from its partner at the link rate; the
        other nodes read theirs from their own RAM, faster, at the same time."""
        return self.state_bytes / nodes / (self.link_gbps / 8 * GB)

    @property
    def in_memory_restart_s(self) -> float:
        return self.restart_s if self.memory_restart_s is None else self.memory_restart_s

    @property
    def copy_s(self) -> float:
        return self.copy_cost * self.step_s


def mtbf_s(inputs: GoodputInputs, nodes: int) -> float:
    """The job's mean time between faults: one node's, shared among the job's nodes."""
    mtbf = HOUR / (inputs.fault_rate * nodes)
    # The rate times the nodes overflowed (--fault-rate 1e308): a fault every 0 s, which every goodput divides by.
    if not mtbf > 0:
        raise SpecError(
            f"--fault-rate {inputs.fault_rate:g}: on {nodes} node(s), a fault every {mtbf:g} s: give faults per "
            "node-hour (Llama 3's: 419 in 54 days on 2,048 nodes, 0.000158)"
        )
    return mtbf


def young_daly_s(cost_s: float, mtbf: float) -> float:
    """The checkpoint interval (seconds of work between checkpoints) that maximises first-order goodput."""
    return math.sqrt(2 * cost_s * mtbf)


def persistent_goodput(inputs: GoodputInputs, nodes: int, interval_s: float) -> float:
    """Persistent checkpoints only: every fault restores from the file system and redoes half an interval."""
    mtbf = mtbf_s(inputs, nodes)
    loss = inputs.detection_s + inputs.restart_s + inputs.fs_restore_s(nodes) + interval_s / 2
    return 1 - inputs.checkpoint_s(nodes) / interval_s - loss / mtbf


def fallback_probability(inputs: GoodputInputs, nodes: int, every_s: float) -> float:
    """The chance a fault must fall back to the persistent checkpoint: the lost node's copy lives on one
    partner node (replicas 1), and that partner is lost too while the copy is needed. After the fault, until
    the replacement has restored from it (detection + restart + restore); before, since the partner's own
    loss took the copy with it, until the lost node's next copy lands on the partner's replacement (the same
    recovery, plus up to one copy interval). Plus the faults no RAM survives (`unrecoverable`)."""
    recovery = inputs.detection_s + inputs.in_memory_restart_s + inputs.peer_restore_s(nodes)
    window = 2 * recovery + every_s
    partner = 1 - math.exp(-inputs.fault_rate / HOUR * window)
    return inputs.unrecoverable + (1 - inputs.unrecoverable) * partner


def memory_goodput(inputs: GoodputInputs, nodes: int, every_s: float, interval_s: float) -> float:
    """In-memory copies every `every_s` of work, persistent checkpoints every `interval_s` for the fallback."""
    mtbf = mtbf_s(inputs, nodes)
    p = fallback_probability(inputs, nodes, every_s)
    from_peers = inputs.peer_restore_s(nodes) + every_s / 2
    from_fs = inputs.fs_restore_s(nodes) + interval_s / 2
    loss = inputs.detection_s + inputs.in_memory_restart_s + (1 - p) * from_peers + p * from_fs
    overhead = inputs.copy_s / every_s + inputs.checkpoint_s(nodes) / interval_s
    return 1 - overhead - loss / mtbf


def best_steps(goodput: Callable[[int], float], most: int) -> int:
    """The whole number of steps in [1, most] that maximises a goodput that rises then falls (C/k falls, the
    lost work k/2 grows): a ternary search over integers, then the last few checked one by one."""
    lo, hi = 1, max(1, most)
    while hi - lo > 3:
        a = lo + (hi - lo) // 3
        b = hi - (hi - lo) // 3
        if goodput(a) < goodput(b):
            lo = a + 1  # the peak is right of a
        else:
            hi = b  # the peak is at or left of b
    return max(range(lo, hi + 1), key=goodput)


@dataclass(frozen=True)
class Outcome:
    """One mode at one scale: goodput at the searched optimum, the intervals, and Young/Daly's for comparison."""

    mode: str  # "persistent" or "in-memory"
    gpus: int
    nodes: int
    mtbf_h: float
    goodput: float
    interval_steps: int  # persistent checkpoint interval (checkpoint.interval)
    interval_s: float
    young_daly_s: float
    checkpoint_s: float  # a persistent checkpoint's blocking cost at this scale
    restore_s: float  # restoring after a fault: from the file system, or (in-memory) from the partner
    every_steps: int | None = None  # in-memory copy interval (checkpoint.memory.every)
    every_s: float | None = None
    every_young_daly_s: float | None = None
    fallback_probability: float | None = None

    def to_json(self) -> dict[str, Any]:
        # Six significant digits: a fallback probability of 1e-5 keeps its own.
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in asdict(self).items()}


def persistent(inputs: GoodputInputs, nodes: int) -> Outcome:
    mtbf = mtbf_s(inputs, nodes)
    most = int(MAX_INTERVAL_S // inputs.step_s)
    k = inputs.ckpt_interval or best_steps(
        lambda k: persistent_goodput(inputs, nodes, k * inputs.step_s), most
    )
    return Outcome(
        mode="persistent",
        gpus=nodes * inputs.gpus_per_node,
        nodes=nodes,
        mtbf_h=mtbf / HOUR,
        goodput=max(0.0, persistent_goodput(inputs, nodes, k * inputs.step_s)),
        interval_steps=k,
        interval_s=k * inputs.step_s,
        young_daly_s=young_daly_s(inputs.checkpoint_s(nodes), mtbf),
        checkpoint_s=inputs.checkpoint_s(nodes),
        restore_s=inputs.fs_restore_s(nodes),
    )


def in_memory(inputs: GoodputInputs, nodes: int, rounds: int = 4) -> Outcome:
    """Both intervals by turns (the copy's, then the persistent one's for the fallback), from Young/Daly's;
    an interval the inputs fix stays."""
    mtbf = mtbf_s(inputs, nodes)
    step = inputs.step_s
    most = int(MAX_INTERVAL_S // step)
    every_yd = young_daly_s(inputs.copy_s, mtbf)
    every = min(most, max(1, round(every_yd / step)))
    p = fallback_probability(inputs, nodes, every * step)
    interval_yd = young_daly_s(inputs.checkpoint_s(nodes), mtbf / p) if p > 0 else math.inf
    interval = min(most, max(1, round(min(interval_yd, MAX_INTERVAL_S) / step)))
    every = inputs.memory_every or every
    interval = inputs.ckpt_interval or interval
    for _ in range(rounds):
        if inputs.memory_every is None:
            fixed = interval * step
            every = best_steps(lambda e, k=fixed: memory_goodput(inputs, nodes, e * step, k), most)
        if inputs.ckpt_interval is None:
            fixed = every * step
            interval = best_steps(lambda k, e=fixed: memory_goodput(inputs, nodes, e, k * step), most)
    return Outcome(
        mode="in-memory",
        gpus=nodes * inputs.gpus_per_node,
        nodes=nodes,
        mtbf_h=mtbf / HOUR,
        goodput=max(0.0, memory_goodput(inputs, nodes, every * step, interval * step)),
        interval_steps=interval,
        interval_s=interval * step,
        young_daly_s=interval_yd,
        checkpoint_s=inputs.checkpoint_s(nodes),
        restore_s=inputs.peer_restore_s(nodes),
        every_steps=every,
        every_s=every * step,
        every_young_daly_s=every_yd,
        fallback_probability=fallback_probability(inputs, nodes, every * step),
    )


def nodes_for(gpus: int, inputs: GoodputInputs) -> int:
    if gpus < 1:
        raise SpecError(f"--nodes {gpus}: must be at least 1")
    return max(1, math.ceil(gpus / inputs.gpus_per_node))


def table(inputs: GoodputInputs, node_counts: list[int] | None = None) -> list[Outcome]:
    """Both modes at each scale: 1k, 4k and 16k GPUs unless node counts are given."""
    counts = node_counts if node_counts is not None else [nodes_for(g, inputs) for g in SCALES_GPUS]
    rows: list[Outcome] = []
    for nodes in counts:
        if nodes < 1:
            raise SpecError(f"--nodes {nodes}: must be at least 1")
        rows += [persistent(inputs, nodes), in_memory(inputs, nodes)]
    return rows


def target_case(inputs: GoodputInputs) -> tuple[Outcome, Outcome]:
    """Issue 44's target case: 16,384 GPUs with a fault every 3 h (the fault rate set to give it), the other
    inputs as given: (persistent-only, in-memory)."""
    nodes = nodes_for(TARGET_GPUS, inputs)
    at_target = replace(inputs, fault_rate=1 / (TARGET_MTBF_H * nodes))
    return persistent(at_target, nodes), in_memory(at_target, nodes)


def _interval(seconds: float) -> str:
    if seconds >= 2 * HOUR:
        return f"{seconds / HOUR:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def assumptions(inputs: GoodputInputs) -> list[str]:
    rate = inputs.fault_rate
    return [
        f"faults: {rate:.3g} a node-hour (one node's MTBF {1 / rate:,.0f} h)"
        + (" = Llama 3's 419 in 54 days on 2,048 nodes" if rate == LLAMA3_FAULTS_PER_NODE_HOUR else ""),
        f"state {inputs.state_bytes / 1e12:.3g} TB; file system {inputs.fs_write_gbs:g} GB/s write, "
        f"{inputs.fs_read_gbs:g} GB/s read, {inputs.node_fs_gbs:g} GB/s a node; save at "
        f"{inputs.save_efficiency:g} x the write rate",
        f"per fault: detection {inputs.detection_s:g} s + restart {inputs.restart_s:g} s "
        f"(in-memory: {inputs.in_memory_restart_s:g} s) + restore + half an interval of work",
        f"in-memory: a copy costs {inputs.copy_cost:.0%} of a {inputs.step_s:g} s step; a lost node's state "
        f"comes back from its partner at {inputs.link_gbps:g} Gb/s; unrecoverable faults {inputs.unrecoverable:.0%}",
    ]


def text(inputs: GoodputInputs, rows: list[Outcome], target: tuple[Outcome, Outcome] | None) -> str:
    """The table `hpkit plan --goodput` prints: per scale, each mode's goodput at its best intervals."""
    header = ("GPUs", "nodes", "MTBF", "mode", "goodput", "ckpt interval (Young/Daly)", "memory every (Y/D)")
    cells = []
    for r in rows:
        every = "-"
        if r.every_s is not None and r.every_young_daly_s is not None:
            every = f"{r.every_steps} steps = {_interval(r.every_s)} ({_interval(r.every_young_daly_s)})"
        yd = _interval(r.young_daly_s) if math.isfinite(r.young_daly_s) else "inf"
        cells.append(
            (
                f"{r.gpus:,}",
                f"{r.nodes:,}",
                f"{r.mtbf_h:.1f} h",
                r.mode,
                f"{r.goodput:.2%}",
                f"{r.interval_steps:,} steps = {_interval(r.interval_s)} ({yd})",
                every,
            )
        )
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *cells]
    ]
    lines += ["", "inputs (override with the flags of `hpkit plan --goodput --help`):"]
    lines += [f"  {line}" for line in assumptions(inputs)]
    lines += [
        f"  persistent checkpoint blocks {inputs.checkpoint_s(rows[0].nodes):.1f} s at {rows[0].nodes:,} nodes; "
        f"restore from the file system {inputs.fs_restore_s(rows[0].nodes):.1f} s, from a partner "
        f"{inputs.peer_restore_s(rows[0].nodes):.2f} s"
    ]
    if target is not None:
        old, new = target
        verdict = "met" if new.goodput >= TARGET_GOODPUT else "missed"
        lines += [
            "",
            f"target (issue 44): {TARGET_GPUS:,} GPUs, a fault every {TARGET_MTBF_H:g} h: in-memory "
            f"{new.goodput:.2%} (>= {TARGET_GOODPUT:.0%}: {verdict}) against persistent-only {old.goodput:.2%}",
        ]
    return "\n".join(lines)
