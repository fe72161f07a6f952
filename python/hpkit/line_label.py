"""Whole, rank-labelled output lines for ranks that share one output pipe (torchrun's ranks on a node).

The ranks of a node inherit torchrun's stdout and stderr. A rank's `print` reaches the pipe in several
writes (text, then newline, when unbuffered), so lines of two ranks interleave: a seed-003 job logged
`... rank 2 of 4 ... node2SMDDP-SCRIPT-OK rank 3 of 4 ...` as one line. Here a rank's fds 1 and 2 go
to pipes read by a small forked process that writes each complete line, prefixed with the rank as
`srun --label` prefixes a task's, in one write(2): writes up to PIPE_BUF (4 KiB) are atomic on a pipe,
so lines of that size stay whole, and one reader per rank keeps the rank's own lines in order. It works
at the file-descriptor level, so C++ output (gloo, NCCL) is labelled too. The reader ignores the job's
signals and ends when the rank and every process that inherited its output have closed it.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Mapping

# Set to 1 by the rendered job (torchrun launcher): hpkit.run_script then routes the streams.
ENV = "HPKIT_LINE_LABEL"

_STREAMS = (1, 2)


def rank_label(environ: Mapping[str, str]) -> str:
    """`srun --label`'s prefix for this rank: the rank, right-aligned to the widest rank, then ': '."""
    rank = environ.get("RANK", "0")
    width = len(str(max(int(environ.get("WORLD_SIZE", "1")) - 1, 0)))
    return f"{rank:>{width}}: "


def split_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines (with their newline) of pending + chunk, and the unfinished rest."""
    data = pending + chunk
    cut = data.rfind(b"\n") + 1
    return data[:cut].splitlines(keepends=True), data[cut:]


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data) :]
        except BrokenPipeError:
            return


def _relay(label: bytes, sources: dict[int, int]) -> None:
    """Reader loop: source pipe -> original fd, one write per labelled line, until every source ends."""
    pending = {src: b"" for src in sources}
    while pending:
        ready, _, _ = select.select(list(pending), [], [])
        for src in ready:
            chunk = os.read(src, 65536)
            if chunk:
                lines, pending[src] = split_lines(pending[src], chunk)
                for line in lines:
                    _write_all(sources[src], label + line)
            else:
                if pending[src]:  # a last line without its newline
                    _write_all(sources[src], label + pending[src] + b"\n")
                del pending[src]


def route_std_streams(label: str) -> None:
    """Send this process's fds 1 and 2 through a labelling reader process (call before any thread starts)."""
    pipes = {fd: os.pipe() for fd in _STREAMS}
    originals = {fd: os.dup(fd) for fd in _STREAMS}
    if os.fork() == 0:  # the reader
        try:
            # The job's signals are for the rank: the reader ends when the output does.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, signal.SIG_IGN)
            for fd, (_read, write) in pipes.items():
                os.close(write)
                os.close(fd)  # the rank's end of the pipe stays only in the rank
            _relay(label.encode(), {read: originals[fd] for fd, (read, _write) in pipes.items()})
        finally:
            os._exit(0)
    for fd, (read, write) in pipes.items():
        os.dup2(write, fd)
        os.close(read)
        os.close(write)
        os.close(originals[fd])
