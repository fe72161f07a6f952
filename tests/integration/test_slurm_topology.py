"""`hpkit check`'s topology check on the real Slurm 24.11 cluster, which runs topology/tree with the topology.conf
that hpkit renders (slurm/dev/up.sh TOPOLOGY=tree, as the session's 24.11 cluster in conftest.py).

The cases a cluster cannot be left in (a node in no switch, a tree without a top switch) are unit tests over
what 22.05 and 24.11 really printed (tests/unit/test_topology.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

HPKIT = str(Path(sys.executable).with_name("hpkit"))


def _check(env: dict[str, str]) -> str:
    done = subprocess.run(
        [HPKIT, "check", "--only", "topology", "--plain", "--timeout", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


def test_check_passes_the_rendered_tree_and_names_a_missing_topology_conf(
    slurm_cluster_24_11: dict[str, str], tmp_path: Path
) -> None:
    conf = Path(slurm_cluster_24_11["SLURM_CONF"])
    assert "TopologyPlugin=topology/tree" in conf.read_text()
    out = _check(slurm_cluster_24_11)
    assert re.search(
        r"^PASS\s+topology\s+.*TopologyPlugin=topology/tree: 2 switches place all 2 nodes", out, re.M
    ), out

    # A login node whose controller is gone (24.11 stops without topology.conf): its slurm.conf asks for the
    # tree, and no topology.conf lies beside it. The copy points at a port where no slurmctld listens.
    copy = tmp_path / "slurm.conf"
    copy.write_text(re.sub(r"(?m)^SlurmctldPort=\d+", "SlurmctldPort=9", conf.read_text()))
    out = _check({**slurm_cluster_24_11, "SLURM_CONF": str(copy)})
    line = next((x for x in out.splitlines() if x.startswith("FAIL") and "topology" in x), None)
    assert line is not None and f"{tmp_path / 'topology.conf'} is missing" in line, out
