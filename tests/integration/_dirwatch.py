"""Directory events from Linux inotify (through libc: no package needed), so that a test acts the moment
a file appears instead of guessing with a sleep."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
from pathlib import Path

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class DirWatch:
    """Names created in (or moved into) watched directories, as (directory, name, is_dir) events."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._dirs: dict[int, Path] = {}

    def add(self, path: Path) -> bool:
        """Watch `path`; False when it is already gone (a directory renamed away in the meantime)."""
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), IN_CREATE | IN_MOVED_TO)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOENT:
                return False
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
        self._dirs[wd] = Path(path)
        return True

    def events(self, timeout: float) -> list[tuple[Path, str, bool]]:
        """Wait up to `timeout` seconds for events; returns all that are queued (maybe none)."""
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return []
        out, offset = [], 0
        while offset < len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            offset += _HEADER.size
            name = data[offset : offset + length].rstrip(b"\0").decode(errors="surrogateescape")
            offset += length
            if wd in self._dirs and mask & (IN_CREATE | IN_MOVED_TO):
                out.append((self._dirs[wd], name, bool(mask & IN_ISDIR)))
        return out

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
