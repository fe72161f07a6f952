"""pytest-xdist's `--dist loadfile`, in the suite's own order: the longest files first, a worker's next file sent late.

xdist's LoadFileScheduling, left alone, undid the order conftest.py gives the files (SLOW_FILES_FIRST) twice over:
- it sorts the files by their number of tests, most first, unless told `--no-loadscope-reorder`: the unit files
  (hundreds of millisecond tests) ran first and the integration files that take minutes (a few tests each) last,
  where one of them kept the run going alone while the other workers had nothing left;
- it gives a worker its next file as soon as two tests of its current one remain: a worker two tests from the end
  of a five-minute file held the next file in its queue while another worker idled.

Here the files run in the collection's order, and a worker gets its next file when one test of its current file
remains: the least xdist's worker allows, since it starts a test only with the next one in hand (pytest's
`nextitem`, which decides the fixtures' teardown).
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController


class CollectionOrderFileScheduling(LoadFileScheduling):
    def __init__(self, config, log=None):
        config.option.loadscopereorder = False  # read by schedule(): keep the collection's file order
        super().__init__(config, log)

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)


# What the subclass leans on: xdist's own scheduler methods (3.5 to 3.8), not its public hooks.
_USED = ("_pending_of", "_assign_work_unit", "_reschedule", "assigned_work")


def make_scheduler(config, log):
    """conftest's pytest_xdist_make_scheduler: this scheduler for `--dist loadfile`, xdist's own otherwise (and
    where an xdist release no longer has what the subclass uses: the suite then runs in xdist's order)."""
    if config.getoption("dist") != "loadfile":
        return None
    scheduler = CollectionOrderFileScheduling(config, log)
    if not all(hasattr(scheduler, name) for name in _USED):
        return None
    return scheduler
