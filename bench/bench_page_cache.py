"""Why a checkpoint save had two speeds: writing a file into freshly allocated page cache, by page origin.

Writes SIZE MiB (1 MiB writes, then fsync) three ways, alternating, for --rounds rounds:
  fresh:    into pages freed a moment ago (the previous file unlinked just before), as `dd` in
            bench_checkpoint.py gets them;
  reported: into pages freed --idle seconds ago, as a save gets them minutes after the last one (on
            a VM with virtio-balloon free page reporting those pages went back to the host, and the
            first write into each faults there);
  window:   as `reported`, through hpkit's 16 MiB writeback window (hpkit.runtime.checkpoints.page_cache).
Prints the seconds spent writing into the page cache and in the final fsync, and the host's page
reporting counter where the kernel has one.

    python3 bench/bench_page_cache.py [--size 700 --rounds 5 --idle 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from hpkit.runtime.checkpoints.page_cache import StreamingWriteback

REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def _write(path: Path, mib: int, window: int) -> tuple[float, float]:
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        stream = StreamingWriteback(fd, window)
        start = time.perf_counter()
        for i in range(mib):
            os.write(fd, block)
            stream.advance((i + 1) << 20)
        written = time.perf_counter()
        os.fsync(fd)
        return written - start, time.perf_counter() - written
    finally:
        os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpkit-bench-pagecache"))
    p.add_argument("--size", type=int, default=700, help="MiB per file")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--idle", type=float, default=3.0, help="seconds between freeing pages and writing (reported)"
    )
    args = p.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / "file"
    cases = {"fresh": (0.0, 0), "reported": (args.idle, 0), "window": (args.idle, 16 << 20)}
    seen: dict[str, list[tuple[float, float]]] = {case: [] for case in cases}
    if REPORTED.exists():
        print(f"page reporting: {REPORTED.read_text().strip()} KiB reported to the host since boot")
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    for r in range(args.rounds):
        names = list(cases)
        for case in names[r % 3 :] + names[: r % 3]:
            idle, window = cases[case]
            _write(target, args.size, 0)  # the pages this case's write will find freed
            target.unlink()
            time.sleep(idle)
            seen[case].append(_write(target, args.size, window))
            target.unlink()
    for case, runs in seen.items():
        write = statistics.median(w for w, _ in runs)
        flush = statistics.median(f for _, f in runs)
        print(
            f"{case:9s} write into page cache {write:.3f} s, fsync {flush:.3f} s, total"
            f" {args.size / 1024 / (write + flush):.2f} GiB/s (write runs {[round(w, 3) for w, _ in runs]})"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    root.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
