"""A NET=netns local cluster: a network namespace and an address per node (slurm/dev/net.sh, issue 37).

Ranks talk across real interfaces here, which loopback never let fail: a 2-node x 2-rank FSDP x TP job equals
one process with an unroutable second interface listed first on every node; the fault helpers cut a node off,
bring it back and slow its link measurably; and down.sh leaves no namespace, veth or bridge behind.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _torchrun
import pytest

from _clusters import slot
from hpkit import devcluster

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
PORT, FIRST_JOB_ID = slot("node-network")
HPKIT = str(Path(sys.executable).with_name("hpkit"))
RTOL = 1e-5  # test_training_correctness.py's
# A TCP connect from one node's namespace to another's port: the seconds it took, or FAIL.
CONNECT = """
import socket, sys, time
start = time.monotonic()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as exc:
    print("FAIL", exc)
else:
    print(time.monotonic() - start)
"""
# Serves BYTES to one client on PORT, then exits.
SERVE = """
import socket, sys
with socket.create_server(("0.0.0.0", int(sys.argv[1]))) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    conn.sendall(b"x" * int(sys.argv[2]))
    conn.close()
"""
RECEIVE = """
import socket, sys, time
start = time.monotonic()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as conn:
    got = 0
    while chunk := conn.recv(65536):
        got += len(chunk)
print(got, time.monotonic() - start)
"""


def _links_and_namespaces() -> str:
    """Every link and namespace of this cluster's that the host holds, one per line."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return "\n".join(
        line for line in (links + spaces).splitlines() if re.search(rf"\bhpk{PORT}[bn]|\bhpkit-{PORT}-", line)
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        pytest.fail("ip or nsenter not found: `make system-deps` installs iproute2 and util-linux")
    env = devcluster.client_env(tmp_path_factory.mktemp("node-network"), PORT, FIRST_JOB_ID, net="netns")
    try:
        devcluster.up(env)
    except devcluster.DevClusterError as exc:
        devcluster.down(env)
        pytest.fail(str(exc))
    yield env
    devcluster.down(env)


def _in_node(env: dict[str, str], node: str, code: str, *args: str) -> str:
    argv = devcluster.node_command(env, node, [sys.executable, "-c", code, *args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def _connect(env: dict[str, str], src: str, dst: str, timeout: float = 1.0) -> str:
    """From `src`'s namespace, a TCP connect to `dst`'s slurmd (its port: the controller's + its number)."""
    port = PORT + int(dst.removeprefix("node"))
    return _in_node(env, src, CONNECT, devcluster.node_address(env, dst), str(port), str(timeout))


def _node_addrs(env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "node", "-o"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return dict(re.findall(r"NodeName=(\S+) .*?NodeAddr=(\S+)", out))


def test_every_node_has_its_own_address_and_reaches_the_others(cluster):
    addrs = _node_addrs(cluster)
    assert set(addrs) == {"node1", "node2"}
    assert addrs == {name: devcluster.node_address(cluster, name) for name in addrs}
    assert len(set(addrs.values())) == 2 and "127.0.0.1" not in addrs.values(), addrs
    assert not _connect(cluster, "node2", "node1").startswith("FAIL")
    assert not _connect(cluster, "node1", "node2").startswith("FAIL")


def test_cut_isolates_a_node_and_restore_brings_it_back(cluster):
    devcluster.cut(cluster, "node1")
    try:
        assert _connect(cluster, "node2", "node1", timeout=0.5).startswith("FAIL")
        assert _connect(cluster, "node1", "node2", timeout=0.5).startswith("FAIL")
    finally:
        devcluster.restore(cluster, "node1")
    # The link carries again at once (well inside slurmd's timeout: the node never went DOWN).
    deadline = time.monotonic() + 10
    while _connect(cluster, "node2", "node1").startswith("FAIL"):
        assert time.monotonic() < deadline, "node1 is still unreachable 10 s after restore"
        time.sleep(0.2)


def _transfer_s(env: dict[str, str], size: int) -> float:
    """Seconds for node2 to receive `size` bytes from node1."""
    port = PORT + 9  # the slot's last port: no slurmd of this 2-node cluster holds it
    argv = devcluster.node_command(env, "node1", [sys.executable, "-c", SERVE, str(port), str(size)])
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        got, seconds = _in_node(
            env, "node2", RECEIVE, devcluster.node_address(env, "node1"), str(port)
        ).split()
        assert int(got) == size
        return float(seconds)
    finally:
        server.wait(timeout=30)


def test_slow_limits_the_rate_and_unslow_lifts_it(cluster):
    size = 1_000_000  # 8 Mbit: 0.8 s at 10 Mbit/s
    devcluster.slow(cluster, "node1", rate="10mbit")
    try:
        slowed = _transfer_s(cluster, size)
    finally:
        devcluster.unslow(cluster, "node1")
    fast = _transfer_s(cluster, size)
    assert slowed >= 0.6, f"1 MB took {slowed:.3f} s at 10 Mbit/s"
    assert fast < slowed / 4, f"unslowed {fast:.3f} s vs slowed {slowed:.3f} s"


def test_slow_delay_shows_in_the_round_trip(cluster):
    # tc netem where the kernel has it, else net.sh's user-space delay (netdelay.py): the same round trip.
    base = min(float(_connect(cluster, "node2", "node1")) for _ in range(3))
    devcluster.slow(cluster, "node1", delay="50ms")
    try:
        slowed = min(float(_connect(cluster, "node2", "node1", timeout=5)) for _ in range(3))
    finally:
        devcluster.unslow(cluster, "node1")
    # A TCP connect is one round trip: 50 ms each way through node1's link.
    assert slowed >= base + 0.09, f"connect {slowed * 1000:.1f} ms slowed vs {base * 1000:.1f} ms"


def test_fsdp_tp_job_across_node_addresses_with_an_unroutable_first_interface_equals_one_process(
    cluster, tmp_path
):
    addrs = _node_addrs(cluster)
    for node in addrs:
        devcluster.second_interface(cluster, node)
        links = _in_node(
            cluster, node, "import socket; print(*[n for _, n in socket.if_nameindex()])"
        ).split()
        # A naive choice, the first interface that is not loopback, is the unroutable one.
        assert next(n for n in links if n != "lo") == "ib0" and "eth0" in links, links
    out = tmp_path / "layouts.json"
    spec = tmp_path / "net.yaml"
    command = [sys.executable, str(HERE / "node_network_job.py"), str(out)]
    spec.write_text(
        json.dumps(
            {"name": "net", "nodes": 2, "tasks_per_node": 2, "launcher": "torchrun", "command": command}
        )
    )
    done = subprocess.run(
        [HPKIT, "submit", str(spec), "--wait", "--poll", "0.5"],
        env=cluster,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = re.search(r"^  output: (\S+)$", done.stdout, re.M)
    log = Path(found.group(1)).read_text() if found and Path(found.group(1)).is_file() else ""
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{log}"
    records = [json.loads(m) for m in re.findall(r"NET (\{[^{}]*\})", log)]
    assert sorted(r["rank"] for r in records) == ["0", "1", "2", "3"], log
    for r in records:
        # Every rank rendezvoused at node1's own address, through the interface that reaches it.
        assert r["master_addr"] == addrs["node1"] != "127.0.0.1", r
        assert r["gloo_ifname"] == "eth0" and r["nccl_ifname"] == "=eth0", r
    assert sorted({r["node"] for r in records}) == ["node1", "node2"]

    reference = tmp_path / "reference.json"
    _torchrun.run([str(HERE / "training_layouts.py"), str(reference), "reference"], tmp_path / "ref", None)
    ref, got = json.loads(reference.read_text())["reference"], json.loads(out.read_text())["fsdp_tp"]
    for key in ("loss", "grad_norm"):
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got[key], ref[key], strict=True))
        assert worst <= RTOL, f"{key}: {got[key]} vs one process {ref[key]}"


def test_down_removes_every_namespace_veth_and_bridge(cluster):
    assert _links_and_namespaces(), "the cluster's network should be up before down.sh"
    devcluster.down(cluster)
    assert _links_and_namespaces() == ""
    assert not list((Path(cluster["HPKIT_DEV_CLUSTER_DIR"]) / "run").glob("*.pid"))  # netdelay.py's too
