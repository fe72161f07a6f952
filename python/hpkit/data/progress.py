"""The preparation's progress on stderr: rows, tokens, tokens/s, ETA (from the input bytes read).

On a terminal one line is redrawn in place a few times a second; otherwise (a Slurm log, a pipe) a plain
line is written every `every_s` seconds, so that logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total_bytes: int, stream: TextIO | None = None, every_s: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (0.2 if self.tty else 10.0)
        self.total_bytes = max(1, total_bytes)
        self.start = time.monotonic()
        self.last = self.start
        self.rows = self.tokens = 0
        self.bytes = 0.0
        # What a resumed run found done already: counted in the totals, not in this run's rates.
        self.base_tokens = 0
        self.base_bytes = 0.0

    def resume_at(self, nbytes: float, rows: int, tokens: int) -> None:
        self.bytes = self.base_bytes = nbytes
        self.tokens = self.base_tokens = tokens
        self.rows = rows

    def add(self, rows: int, tokens: int, nbytes: float) -> None:
        self.rows += rows
        self.tokens += tokens
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self._write(self.line(now), final=False)

    def done(self) -> None:
        self._write(self.line(time.monotonic(), done=True), final=True)

    def tokens_per_s(self, now: float | None = None) -> float:
        elapsed = max((now if now is not None else time.monotonic()) - self.start, 1e-9)
        return (self.tokens - self.base_tokens) / elapsed

    def line(self, now: float, done: bool = False) -> str:
        elapsed = max(now - self.start, 1e-9)
        parts = [
            f"hpkit data: {self.rows:,} rows",
            f"{self.tokens:,} tokens",
            f"{self.tokens_per_s(now):,.0f} tokens/s",
            f"{min(100.0, 100.0 * self.bytes / self.total_bytes):.0f}%",
        ]
        byte_rate = (self.bytes - self.base_bytes) / elapsed
        if done:
            parts.append(f"done in {_clock(elapsed)}")
        elif byte_rate > 0:
            parts.append(f"ETA {_clock(max(0.0, self.total_bytes - self.bytes) / byte_rate)}")
        return " | ".join(parts)

    def _write(self, line: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
