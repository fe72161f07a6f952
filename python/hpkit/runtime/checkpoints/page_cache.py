"""Streaming a large file to disk through a small window of the page cache.

A file written the ordinary way sits whole in the page cache, dirty, until its fsync flushes it all.
That costs twice: the flush only starts at the end, and every page of the file is a newly allocated
one. The second cost dominates on virtual machines whose free memory goes back to the hypervisor
(virtio-balloon free page reporting): a page allocated from that memory faults on the host before
the copy into it completes. On the 2-vCPU test VM, writing 700 MiB into the page cache took 0.09 s
when the pages had just been freed and 0.8-1.5 s when they had already been reported back
(BENCHMARKS.md, P4): the two modes of a checkpoint save.

`StreamingWriteback` keeps the file's footprint to two chunks: after each chunk it starts the
chunk's writeback, waits for the previous chunk's (usually long done), and drops those now-clean
pages, so the writer keeps reusing the same pages and the disk works while the next chunk is
serialised. Durability is unchanged: the file's fsync still follows (sync_file_range neither
flushes the disk's cache nor writes metadata).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections import deque
from collections.abc import Callable

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* from <fcntl.h>
# The file cannot take part (a pipe, a filesystem without the call): the fsync alone then.
_UNSUPPORTED = {errno.ESPIPE, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


_sync_file_range = _load_sync_file_range()


class StreamingWriteback:
    """Call `advance(size)` after each write of a file written front to back on descriptor `fd`."""

    def __init__(self, fd: int, chunk_bytes: int, in_flight: int = 2) -> None:
        self.fd = fd
        self.chunk = chunk_bytes
        self.in_flight = in_flight  # chunks whose writeback may run while the writer goes on
        self.active = chunk_bytes > 0 and _sync_file_range is not None
        self._queued = 0  # bytes [0, _queued) have had their writeback started
        self._behind: deque[tuple[int, int]] = deque()  # started, not yet waited for and dropped

    def advance(self, size: int) -> None:
        if not self.active or size - self._queued < self.chunk:
            return
        start, self._queued = self._queued, size
        if not self._sync(start, size, _WRITE):
            return
        self._behind.append((start, size))
        if len(self._behind) <= self.in_flight:
            return
        begin, end = self._behind.popleft()
        if not self._sync(begin, end, _WAIT_BEFORE | _WRITE | _WAIT_AFTER):
            return
        try:
            os.posix_fadvise(self.fd, begin, end - begin, os.POSIX_FADV_DONTNEED)
        except OSError:
            self.active = False

    def _sync(self, start: int, end: int, flags: int) -> bool:
        assert _sync_file_range is not None
        if _sync_file_range(self.fd, start, end - start, flags) == 0:
            return True
        code = ctypes.get_errno()
        if code in _UNSUPPORTED:
            self.active = False
            return False
        # Waiting on a range consumes the file's writeback error: the fsync that follows would then
        # succeed although these bytes never reached the disk. Raise it here instead.
        raise OSError(code, f"writing back bytes {start}-{end}: {os.strerror(code)}")
