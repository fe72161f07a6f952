"""`hpkit bench collectives` as a 2-node x 2-task Slurm job on the local cluster (gloo)."""

from __future__ import annotations

import sys
import time

import pytest
import yaml
from test_slurm_jobs import output_of, submit

from hpkit.netbench.bandwidth import bus_factor
from hpkit.netbench.results import from_csv
from hpkit.slurm import CliBackend, JobState, wait

pytestmark = pytest.mark.cluster

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]


def test_collectives_job_reports_nccl_tests_bandwidths(slurm_cluster, tmp_path, repo):
    # The example spec, with a small sweep so that the test stays short.
    spec = yaml.safe_load((repo / "slurm/jobs/collectives.yaml").read_text())
    csv_path = tmp_path / "collectives.csv"
    spec["command"] = [
        sys.executable, "-m", "hpkit", "bench", "collectives", "-b", "1K", "-e", "64K", "-f", "8",
        "-n", "3", "-w", "1", "--csv", str(csv_path),
    ]  # fmt: skip
    assert (spec["nodes"], spec["tasks_per_node"]) == (2, 2)
    job_id = submit(spec, tmp_path, slurm_cluster)
    info = wait(CliBackend(), job_id, poll_s=0.5, timeout_s=180)
    log = output_of(info)
    assert info.state == JobState.COMPLETED, log
    assert "4 rank(s), backend gloo" in log
    deadline = time.monotonic() + 10
    while not csv_path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    rows = from_csv(csv_path.read_text())
    assert sorted({r.op for r in rows}) == sorted(OPS)
    assert len(rows) == len(OPS) * 3  # 1K, 8K, 64K
    for row in rows:
        assert row.ranks == 4 and row.backend == "gloo"
        assert row.wrong == 0, row  # every collective returned the values it must
        seconds = row.time_us * 1e-6
        assert row.algbw_gbps == pytest.approx(row.size_bytes / seconds / 1e9, rel=1e-9)
        assert row.busbw_gbps == pytest.approx(row.algbw_gbps * float(bus_factor(row.op, 4)), rel=1e-9)
    by_op = {(r.op, r.size_bytes): r for r in rows}
    # nccl-tests' S: all_gather and reduce_scatter report the whole array, n x the per-rank chunk.
    assert by_op[("all_gather", 65536)].count == 65536 // 4 // 4
    assert by_op[("all_reduce", 65536)].count == 65536 // 4
