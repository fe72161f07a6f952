"""When the probe of a failing step's nodes has its answer: which nodes do not answer.

A node answers by starting a one-task step (`srun --overlap ... true`). A lost node never answers (a dead machine
sends nothing back) or fails at once (a refused connection); a healthy one answers within a second on a quiet
cluster and within a few under load. Waiting the whole PROBE_TIMEOUT_S on every fault was the largest part of a
recovery from memory (5 s of 16.6 s at 125M, BENCHMARKS.md). So a node still silent once PROBE_FACTOR times the
slowest answer has passed (and at least PROBE_MIN_S) is called silent: the slowest answer is this cluster's own
measure of how loaded its controller and nodes are at that moment, and load stretches every node's answer alike.
Until some node has answered, the probe waits the whole timeout: a slow controller and dead nodes look the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

PROBE_TIMEOUT_S = 5.0  # at most: a healthy node starts a task well within it
PROBE_MIN_S = 1.5  # at least: a node is never called silent sooner
PROBE_FACTOR = 3.0  # x the slowest answer
# srun's line when a task cannot start on a node (22.05 and 24.11): "srun: error: Task launch for StepId=12.3
# failed on node node17: Communication connection failure".
_LAUNCH_FAILED = re.compile(r"^srun: error: Task launch for \S+ failed on node ([^:\s]+):")
# sinfo's short node states (%t) that mean a node is gone: down, failing, or not answering slurmctld's pings (the
# trailing `*`). Drained nodes are an administrator's choice, not a failure. The supervisor's plan carries it.
LOST_NODE_STATES = r"^(down|fail)|[*]$"

# (answered: node -> seconds, failed: nodes srun named, ended: whether srun ended before the answer was known)
Together = Callable[[Sequence[str]], tuple[Mapping[str, float], Sequence[str], bool]]


def silent_nodes(
    nodes: Sequence[str], answered: Mapping[str, float], failed: Sequence[str], elapsed: float
) -> list[str] | None:
    """The nodes (in `nodes`' order) that do not answer, once that is known; None while the probe must wait.

    `answered`: each node that started its task, with the seconds it took; `failed`: the nodes whose probe ended
    in an error; `elapsed`: seconds since the probes started."""
    pending = [n for n in nodes if n not in answered and n not in failed]
    known = not pending or elapsed >= PROBE_TIMEOUT_S
    if not known and answered:
        known = elapsed >= max(PROBE_MIN_S, PROBE_FACTOR * max(answered.values()))
    return [n for n in nodes if n not in answered] if known else None


def launch_failed_node(line: str) -> str | None:
    """The node that srun's line says a task could not start on; None for any other line."""
    match = _LAUNCH_FAILED.match(line)
    return match.group(1) if match else None


def unanswering(
    nodes: Sequence[str],
    together: Together,
    gone: Callable[[Sequence[str]], Sequence[str]],
    each: Callable[[Sequence[str]], Sequence[str]],
) -> list[str]:
    """The nodes, in `nodes`' order, that do not start a task: one probe of them all (`together`: one srun) and,
    where it leaves nodes unknown, the fewest further calls.

    srun that ends before every node answered or was named left the rest unknown. Most often slurmctld refused
    the whole step ("Requested node configuration is not available") because it already calls a node gone; one
    node's state answers for that node in one `gone` call (sinfo), and the others are probed together again
    without it. Only nodes still unknown then are probed one by one (`each`), which at thousands of nodes means
    thousands of srun processes and steps."""
    answered, failed, ended = together(nodes)
    silent = set(failed)
    if not ended:
        return [n for n in nodes if n not in answered]
    unknown = [n for n in nodes if n not in answered and n not in silent]
    if unknown:
        lost = set(gone(unknown))
        silent |= lost
        unknown = [n for n in unknown if n not in lost]
        if unknown and lost:
            answered, failed, ended = together(unknown)
            silent |= set(failed)
            if not ended:
                silent |= {n for n in unknown if n not in answered}
            unknown = [n for n in unknown if n not in answered and n not in failed] if ended else []
        if unknown:
            silent |= set(each(unknown))
    return [n for n in nodes if n in silent]
