"""A warm rank that outlives its step (resilience.keep_survivors): when its process group breaks under it (a peer
lost), or its step ends while the group still works (its client gone: the zygote sends STEP_ENDED_SIGNAL), the rank
leaves the group, tells its node's zygote it is parked, and waits; the next step's request on that
node for the same command adopts it instead of forking a new process, and it goes on in the same process with
that step's environment, folder, stdin, stdout and stderr (hpkit.warm.become), keeping what the process had
made: its imports, a GPU's context, compiled kernels.

The zygote gives every rank it forks a channel (`attach`); a rank started cold has none, and cannot stay.
Standard library only."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from types import FrameType

from hpkit.warm.become import become
from hpkit.warm.protocol import receive, send

_channel: socket.socket | None = None
# When a later step adopted this process (Unix seconds), and how many times: None and 0 in a process as forked.
adopted_at: float | None = None
adoptions = 0
# What the zygote sends a rank that may stay when its client has gone while its group still works (a step stopped
# for another rank's hang, its own client killed): its step has ended, and it must not train or save on in it.
# A real-time signal: no program's own, and its default (ending the process) is what a rank that cannot stay
# got before.
STEP_ENDED_SIGNAL = signal.SIGRTMIN + 3
step_ended = False


class StepEnded(Exception):
    """Raised by a rank that may stay where its step has ended (STEP_ENDED_SIGNAL): it leaves its group and parks."""


def watch_step_end() -> None:
    """Have STEP_ENDED_SIGNAL set `step_ended` (from then on, in this process)."""
    signal.signal(STEP_ENDED_SIGNAL, _ended)


def _ended(_signum: int, _frame: FrameType | None) -> None:
    global step_ended
    step_ended = True


def attach(channel: socket.socket) -> None:
    """The zygote's side: this forked rank's end of its channel."""
    global _channel
    _channel = channel


def available() -> bool:
    """Whether this process can stay for the next step: a zygote forked it and still answers on its channel."""
    return _channel is not None and _channel.fileno() >= 0


def offer() -> None:
    """Tell the zygote that this rank may park: when its step ends while it is leaving a broken group, the zygote
    gives it a moment to park (hpkit.warm.zygote.PARK_WINDOW_S) instead of killing it at once."""
    if _channel is not None:
        with contextlib.suppress(OSError):
            send(_channel, {"may_stay": True})


def stay() -> bool:
    """Park until a later step on this node adopts this process; True once it has (this process is then that
    step's rank: environment, folder and streams), False where the zygote is gone. Its streams go to /dev/null
    meanwhile: the old step's pipes close with it."""
    global adopted_at, adoptions, step_ended
    if _channel is None:
        return False
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    try:
        send(_channel, {"parked": True})
    except OSError:
        return False
    while True:
        try:
            message, fds = receive(_channel, max_fds=3)
        except InterruptedError:
            continue
        except OSError:
            return False
        if message is None:
            return False
        if "adopt" in message:
            become(message["adopt"], fds)
            adopted_at, adoptions, step_ended = time.time(), adoptions + 1, False
            return True
        for fd in fds:
            os.close(fd)
