"""`hpkit status` without a job id: the user's jobs as a table (id, name, state, nodes, elapsed, time left, reason)."""

from __future__ import annotations

from collections.abc import Sequence

from hpkit.slurm import JobInfo, JobState

HEADERS = ("JOBID", "NAME", "STATE", "NODES", "ELAPSED", "TIME LEFT", "REASON")


def slurm_duration(seconds: float | None) -> str:
    """Seconds as Slurm writes durations: [D-]HH:MM:SS."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{clock}" if days else clock


def row(info: JobInfo, now: float) -> tuple[str, ...]:
    started = info.start_time is not None and info.state not in (JobState.PENDING, JobState.REQUEUED)
    elapsed = now - info.start_time if started and info.start_time else None
    if info.state.finished:
        # end_time is when it (this run, for a requeued preemption) ended; nothing is left
        elapsed = info.end_time - info.start_time if started and info.start_time and info.end_time else None
        left = "-"
    elif info.time_limit_min is None:
        left = "UNLIMITED"
    elif started and info.end_time:
        left = slurm_duration(info.end_time - now)
    else:
        left = slurm_duration(info.time_limit_min * 60)
    count = "" if info.node_count is None else str(info.node_count)
    nodes = f"{count} {info.nodes}".strip() if info.nodes else count
    reason = "" if info.reason in ("None", "(null)") else info.reason
    return (
        info.job_id,
        info.name,
        info.state_text,
        nodes or "-",
        slurm_duration(elapsed),
        left,
        reason or "-",
    )


def format_table(jobs: Sequence[JobInfo], now: float) -> str:
    if not jobs:
        return "no jobs of yours in the queue"
    rows = [HEADERS, *(row(j, now) for j in jobs)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
