"""Several ranks print many long lines at once: the job's log holds every line whole, labelled with
its rank as `srun --label` labels, each rank's lines in the order it wrote them, in both launch modes."""

from __future__ import annotations

import re
import sys

import pytest
from test_slurm_jobs import output_of, submit

from hpkit.slurm import CliBackend, JobState, wait

pytestmark = pytest.mark.cluster

LINES = 400
WIDTH = 600  # long lines, well under a pipe's atomic 4 KiB

# Each line goes out in two writes (text, then newline), as an unbuffered print does: the window in
# which another rank's line lands in the middle of it.
TALKER = f"""\
import os, sys
rank = os.environ.get("RANK") or os.environ["SLURM_PROCID"]
for i in range({LINES}):
    sys.stdout.write(f"LINE-TEST rank {{rank}} line {{i}} " + "x" * {WIDTH})
    sys.stdout.flush()
    sys.stdout.write("\\n")
    sys.stdout.flush()
"""

LINE = re.compile(rf"^(\d+): LINE-TEST rank (\d+) line (\d+) x{{{WIDTH}}}$")


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_lines_of_many_ranks_stay_whole_labelled_and_in_order(slurm_cluster, tmp_path, launcher):
    (tmp_path / "talk.py").write_text(TALKER)
    spec = {
        "name": f"lines-{launcher}",
        "nodes": 2,
        "tasks_per_node": 2,
        "launcher": launcher,
        "env": {"PYTHONUNBUFFERED": "1"},
        "command": [sys.executable, str(tmp_path / "talk.py")],
    }
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=240)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log[-3000:]
    seen: dict[int, list[int]] = {}
    for line in log.splitlines():
        if "LINE-TEST" not in line:
            continue
        match = LINE.match(line)
        assert match, f"a broken or unlabelled line: {line[:200]!r}"
        label, rank, number = (int(g) for g in match.groups())
        assert label == rank, f"rank {rank}'s line labelled {label}"
        seen.setdefault(rank, []).append(number)
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, numbers in seen.items():
        assert numbers == list(range(LINES)), f"rank {rank}'s lines are missing or out of order"
