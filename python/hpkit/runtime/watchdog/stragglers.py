"""Stragglers: find the rank that drags a synchronous job, from how long each rank takes for its own work.

A rank's step time cannot show it: in synchronous training every rank waits for the slowest one at each
collective, so over a window all ranks measure the same wall time (the slow rank's). What differs is
the time a rank spends on work that waits for no other rank. On a GPU that is the segments between
collectives that the step can time alone (loading its batch, clipping its gradient shards, its optimizer
step; CUDA events). On a CPU it is the whole step's compute: the training thread's time running or
waiting for a core (the kernel's schedstat), which leaves out only the time it sleeps in a collective
for the other ranks; a rank starved of CPU in bursts (a cgroup quota's 100 ms period) is slow in its
forward and backward as much as in its ~1 ms optimizer step, which a burst would mostly miss. Each rank
sums that local work over a window of steps; at the window's end the ranks exchange the means (one all-gather of 2 x world floats on a CPU group, started without
waiting and read at the next step, so no step waits for it) and every rank runs the same detector on
the same numbers.

The detector is a pure function of those numbers (`StragglerDetector`): a rank whose local work time is
more than `factor` times the median of the other ranks' in `windows` windows in a row is reported once;
it is reported again only after it has recovered and fallen behind again.

A slow link does not show in local work: a node whose network is slow makes every rank wait in the same
collectives, and its own ranks sleep there like the others. With `link_probe_bytes` set, each window also
times the nodes' links (`LinkProbe`): the first rank of each node sends that many bytes to the next node's
and receives as many from the previous one's, around a ring of the nodes, all at once after a barrier, three
times, the fastest counted (load only ever adds time; a slow link cannot be beaten by luck). A
link shows in both nodes that it joins, so a node's figure is the faster of its two links (in from the
previous node, out to the next): only a node whose links are all slow stands out, and the same detector
names it. It takes three nodes; with two, both share the one link and neither can be told.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpkit.runtime.config import StragglerSpec

# ----------------------------------------------------------------------------------------------------
# The decision (pure)


def slowdowns(times: Sequence[float]) -> list[float]:
    """Each rank's time over the median of the other ranks' times (1.0 where there is nothing to compare).

    The median of the others, not of all: with two ranks the median of all is their mean, which no rank
    can exceed by a factor of 2 or more, however slow it is.
    """
    out = []
    for rank, own in enumerate(times):
        others = [t for r, t in enumerate(times) if r != rank]
        median = statistics.median(others) if others else 0.0
        out.append(own / median if median > 0 else 1.0)
    return out


@dataclass(frozen=True)
class Straggler:
    rank: int
    factor: float  # its local work time over the median of the others'
    seconds: float  # its mean local work per step in the window
    median_s: float  # the other ranks' median


@dataclass
class StragglerDetector:
    factor: float
    windows: int
    streaks: dict[int, int] = field(default_factory=dict)

    def update(self, times: Sequence[float]) -> list[Straggler]:
        """Feed one window's per-rank times; returns the ranks that have just been slow `windows` times in a row."""
        found = []
        for rank, ratio in enumerate(slowdowns(times)):
            if ratio > self.factor:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
                if self.streaks[rank] == self.windows:
                    others = [t for r, t in enumerate(times) if r != rank]
                    found.append(Straggler(rank, ratio, times[rank], statistics.median(others)))
            else:
                self.streaks.pop(rank, None)
        return found


def ring_link_figures(receive_s: Sequence[float]) -> list[float]:
    """Each node's link figure from one ring exchange, where node i received from node i-1 in receive_s[i]:
    the faster of its link in (receive_s[i]) and its link out (node i+1's receive). A slow node makes both
    of its links slow; each of its neighbours keeps one fast link."""
    n = len(receive_s)
    return [min(receive_s[i], receive_s[(i + 1) % n]) for i in range(n)]


# ----------------------------------------------------------------------------------------------------
# The measurement (torch)


@dataclass(frozen=True)
class Window:
    """One window's exchanged numbers, the same on every rank."""

    step: int  # the window's last step
    steps: int
    local_work_s: list[float]  # per rank, mean per step
    step_s: list[float]  # per rank, mean per step (nearly equal: see the module's docstring)
    ratios: list[float]  # per rank: local work over the median of the others'
    stragglers: list[Straggler]
    # With the link probe (three nodes or more): per node, in LinkProbe.nodes' order, its figure (seconds),
    # and the nodes whose links have just been slow `windows` times in a row (Straggler.rank: the node's index).
    link_s: list[float] = field(default_factory=list)
    slow_links: list[Straggler] = field(default_factory=list)


def _schedstat_path() -> Path | None:
    """The calling thread's schedstat (Linux with CONFIG_SCHED_INFO), or None where it cannot be read."""
    path = Path("/proc/thread-self/schedstat")
    try:
        _wanted_s(path)
    except (OSError, ValueError, IndexError):
        return None
    return path


def _wanted_s(path: Path) -> float:
    """Seconds this thread has spent on a CPU plus waiting for one (run delay, which includes the time a
    CPU quota holds it back); time asleep (in a collective, on I/O) is in neither."""
    on_cpu_ns, run_delay_ns, _ = path.read_text().split()
    return (int(on_cpu_ns) + int(run_delay_ns)) / 1e9


class WorkTimer:
    """Sums a rank's local work over a window.

    On CUDA: the timed segments, with events read only at a window's end (a host clock would time the
    kernel launches, not the work). On a CPU with schedstat: the whole step's running-or-runnable time of
    the training thread, plus the wall time of host segments (a batch the thread waits for from loader
    workers is this rank's own delay, though it sleeps). Elsewhere: the segments on the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Read from the thread that trains: the first call is made there, in the trainer's set-up.
        self._schedstat = None if self.cuda else _schedstat_path()

    @contextmanager
    def step(self) -> Iterator[None]:
        """One whole training step."""
        if self._schedstat is None:
            yield
            return
        start = _wanted_s(self._schedstat)
        yield
        self.seconds += _wanted_s(self._schedstat) - start

    @contextmanager
    def host(self) -> Iterator[None]:
        """Work the host does itself, or waits for on this rank's behalf (loading a batch): its wall time."""
        start = time.perf_counter()
        wanted = _wanted_s(self._schedstat) if self._schedstat is not None else 0.0
        yield
        self.seconds += time.perf_counter() - start
        if self._schedstat is not None:  # counted by step() too
            self.seconds -= _wanted_s(self._schedstat) - wanted

    @contextmanager
    def device(self) -> Iterator[None]:
        """Work queued on the device (clipping, the optimizer step)."""
        if self._schedstat is not None:  # counted by step()
            yield
            return
        if not self.cuda:
            with self.host():
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((start, end))

    def take(self) -> float:
        """The window's total so far, and start a new one. Waits for the last timed kernel on CUDA."""
        total = self.seconds
        if self._events:
            self._events[-1][1].synchronize()
            total += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
            self._events.clear()
        self.seconds = 0.0
        return total


# Rounds of the ring exchange per window, the fastest counted: on the 2 loaded cores of CI, one round named no
# node at a tenth of the link's rate (the fast links' rounds waited for a scheduled peer as long as the slow one's).
PROBE_ROUNDS = 3


class LinkProbe:
    """Times each node's links once per window: a ring exchange between the first ranks of the nodes.

    Every rank of the group calls `measure` (a barrier first, so that no transfer waits for a peer still at
    its step); the others return 0 at once."""

    def __init__(self, group: dist.ProcessGroup, rank_nodes: Sequence[str], size_bytes: int) -> None:
        self.group = group
        firsts: dict[str, int] = {}
        for rank, node in enumerate(rank_nodes):
            firsts.setdefault(node, rank)
        self.nodes = list(firsts)
        self.leaders = list(firsts.values())  # group ranks, one per node, in the nodes' order
        me = dist.get_rank(group)
        self.index = self.leaders.index(me) if me in self.leaders else None
        elements = max(1, size_bytes // 4)
        self.send = torch.ones(elements)
        self.recv = torch.empty(elements)

    @property
    def usable(self) -> bool:
        return len(self.leaders) >= 3

    def measure(self) -> float:
        """Seconds this node's first rank took to receive the probe from the previous node, the best of
        `PROBE_ROUNDS` (0 elsewhere).

        The best, not the one: a round is slowed by whichever rank of the two the host did not run at once
        (a busy CPU, another job's threads), and that only ever adds time. A slow link cannot be beaten by
        luck, so the fastest round is the link's."""
        dist.barrier(group=self.group)
        if self.index is None:
            return 0.0
        n = len(self.leaders)
        to = dist.get_global_rank(self.group, self.leaders[(self.index + 1) % n])
        frm = dist.get_global_rank(self.group, self.leaders[(self.index - 1) % n])
        best = float("inf")
        for _ in range(PROBE_ROUNDS):
            start = time.perf_counter()
            sending = dist.isend(self.send, dst=to, group=self.group)
            receiving = dist.irecv(self.recv, src=frm, group=self.group)
            receiving.wait()
            best = min(best, time.perf_counter() - start)
            sending.wait()
        return best


class StragglerMonitor:
    """Times each step's local work, exchanges window means and runs the detector (every rank alike)."""

    def __init__(
        self, spec: StragglerSpec, group: dist.ProcessGroup, device: torch.device, node: str
    ) -> None:
        self.spec = spec
        self.group = group
        self.world = dist.get_world_size(group)
        self.timer = WorkTimer(device)
        self.detector = StragglerDetector(spec.factor, spec.windows)
        # Once, at start-up: which node each rank runs on, for the warning.
        names: list[object] = [None] * self.world
        dist.all_gather_object(names, node, group=group)
        self.nodes = [str(n) for n in names]
        self.links = LinkProbe(group, self.nodes, spec.link_probe_bytes) if spec.link_probe_bytes else None
        if self.links is not None and not self.links.usable:
            self.links = None  # fewer than three nodes: no link can be told from another
        self.link_detector = StragglerDetector(spec.factor, spec.windows)
        self._steps = 0
        self._step_seconds = 0.0
        self._pending: tuple[object, list[torch.Tensor], int, int] | None = None

    def end_step(self, step: int, step_time_s: float) -> Window | None:
        """Count a finished step; returns the previous window's verdict once its exchange is in."""
        window = self.settle()
        self._steps += 1
        self._step_seconds += step_time_s
        if self._steps == self.spec.every_steps:
            link_s = self.links.measure() if self.links is not None else 0.0
            mine = torch.tensor([self.timer.take() / self._steps, self._step_seconds / self._steps, link_s])
            gathered = [torch.zeros(3) for _ in range(self.world)]
            work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
            self._pending = (work, gathered, step, self._steps)
            self._steps, self._step_seconds = 0, 0.0
        return window

    def settle(self) -> Window | None:
        """Finish the exchange in flight (at the next step, and before teardown) and judge it."""
        if self._pending is None:
            return None
        work, gathered, step, steps = self._pending
        self._pending = None
        work.wait()  # type: ignore[attr-defined]
        local = [float(t[0]) for t in gathered]
        wall = [float(t[1]) for t in gathered]
        link_s: list[float] = []
        slow_links: list[Straggler] = []
        if self.links is not None:
            link_s = ring_link_figures([float(gathered[r][2]) for r in self.links.leaders])
            slow_links = self.link_detector.update(link_s)
        return Window(
            step, steps, local, wall, slowdowns(local), self.detector.update(local), link_s, slow_links
        )
