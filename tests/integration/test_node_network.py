"""A NET=netns local cluster: a network namespace and an address per node (slurm/dev/net.sh, issue 37).

Ranks talk across real interfaces here, which loopback never let fail: a 2-node x 2-rank FSDP x TP job equals
one process with an unroutable second interface listed first on every node; the fault helpers cut a node off,
bring it back and slow its link measurably; and down.sh leaves no namespace, veth or bridge behind.

Network faults, found by hpkit (4 nodes, an unroutable ib0 on each; one training spec: 3 step nodes x 1 rank
and a spare, the hang watchdog and the link probe on):
- `hpkit check` names the *_SOCKET_IFNAME variable to set, in one line, where its value cannot reach the
  rendezvous;
- node3's link slowed to a twentieth of what one node sends another: `hpkit check --all-nodes --bandwidth` and the
  straggler detector's link probe name node3 and no other node; that run's losses are the reference;
- a step node's link cut at a step: the watchdog names the node (or the supervisor's probe alone, where Slurm
  calls the node failed first), a spare takes its place within 30 s of the cut, and the run ends with the
  reference losses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _torchrun
import pytest
from test_resilience import events_of, job_events, job_log, losses, submit, training_spec, wait_for

from _clusters import slot
from hpkit import devcluster
from hpkit.netbench.pairs import CONFIRM_TRIES
from hpkit.slurm import CliBackend, JobState

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
PORT, FIRST_JOB_ID = slot("node-network")
HPKIT = str(Path(sys.executable).with_name("hpkit"))
RTOL = 1e-5  # test_training_correctness.py's
NODES = ("node1", "node2", "node3", "node4")
SLOW, CUT = "node3", "node4"  # step nodes (the batch host, node1, is the spare), neither the rendezvous's
STEPS, INTERVAL, CUT_AT = 24, 10, 12
# Named within 30 s of the cut, the spare in its place: issue 37's bound.
SPARE_BOUND_S = 30.0
# Some 12 ms a round on a fast link here (quiet machine), some 0.5 s at 1/SLOW_BY. Under CI's load (20-30 on 2
# cores) the probe once named no node in two windows in a row at a tenth and 2 MiB (27 ms a round): a fast round
# also waits for its peers to be scheduled, tens of ms under that load. At a tenth, with 14 busy loops beside it,
# node3 was named at 70-106x; the test leaves a margin that CI's load does not close.
LINK_PROBE_BYTES = 8 << 20
SLOW_BY = 20
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
    env = devcluster.client_env(
        tmp_path_factory.mktemp("node-network"), PORT, FIRST_JOB_ID, nodes=len(NODES), net="netns"
    )
    try:
        devcluster.up(env)
    except devcluster.DevClusterError as exc:
        devcluster.down(env)
        pytest.fail(str(exc))
    # CliBackend (hpkit.slurm.wait) asks the cluster that SLURM_CONF names.
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    try:
        yield env
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
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
    assert set(addrs) == set(NODES)
    assert addrs == {name: devcluster.node_address(cluster, name) for name in addrs}
    assert len(set(addrs.values())) == len(NODES) and "127.0.0.1" not in addrs.values(), addrs
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
    """Seconds for node2 to receive `size` bytes from node1 (one TCP stream)."""
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
    base = min(float(_connect(cluster, "node2", "node1")) for _ in range(5))
    devcluster.slow(cluster, "node1", delay="50ms")
    try:
        slowed = min(float(_connect(cluster, "node2", "node1", timeout=5)) for _ in range(3))
    finally:
        devcluster.unslow(cluster, "node1")
    # A TCP connect is one round trip: 50 ms each way through node1's link, so never under 100 ms. Against the
    # floor, not base + 100 ms: on this shared machine (load 40) the best of a few unslowed connects took 15 ms.
    shown = f"connect {slowed * 1000:.1f} ms slowed vs {base * 1000:.1f} ms"
    assert slowed >= 0.095 and base <= slowed - 0.05, shown


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


def _check_ifname(env: dict[str, str], node: str, **variables: str) -> dict:
    """`hpkit check --only socket-ifname` in the node's namespace, the rendezvous at node1's address."""
    run_env = {**env, "MASTER_ADDR": devcluster.node_address(env, "node1"), **variables}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name not in variables:
            run_env.pop(name, None)
    argv = [
        sys.executable,
        "-m",
        "hpkit",
        "check",
        "--profile",
        "compute",
        "--only",
        "socket-ifname",
        "--json",
    ]
    done = subprocess.run(
        devcluster.node_command(env, node, argv), env=run_env, capture_output=True, text=True, timeout=60
    )
    (row,) = json.loads(done.stdout)["checks"]
    assert "\n" not in row["detail"] and "\n" not in row["fix"], row
    return row


def test_check_names_the_socket_ifname_variable_to_set_in_one_line(cluster):
    devcluster.second_interface(cluster, "node2")  # ib0, unroutable, listed before eth0
    wrong = _check_ifname(cluster, "node2", GLOO_SOCKET_IFNAME="ib0")
    assert wrong["status"] == "FAIL", wrong
    assert "GLOO_SOCKET_IFNAME=ib0 cannot reach the rendezvous" in wrong["detail"], wrong
    assert wrong["detail"].endswith("set GLOO_SOCKET_IFNAME=eth0"), wrong
    nccl = _check_ifname(cluster, "node2", NCCL_SOCKET_IFNAME="ib")
    assert nccl["status"] == "FAIL" and nccl["detail"].endswith("set NCCL_SOCKET_IFNAME==eth0"), nccl
    # Unset: NCCL's own choice would be ib0; hpkit's launches set both, others are told what to set.
    unset = _check_ifname(cluster, "node2")
    assert unset["status"] == "WARN" and "NCCL would prefer ib0" in unset["detail"], unset
    assert "GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME==eth0" in unset["detail"], unset
    right = _check_ifname(cluster, "node2", GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="=eth0")
    assert right["status"] == "PASS" and "eth0 reaches the rendezvous" in right["detail"], right


# The hang watchdog's limits. The slow-link run is the reference, and a slow link is not a hang: its limit is
# the product's default, far above any step of this job however loaded the machine (with min_s 3, at load ~10
# on 2 cores, a step over the slowed link outlasted the limit: false hangs spent the restart budget, and the
# cut-link test, which compares with its losses, failed with it). The cut-link run must name the cut node in
# time for the spare to take its place within SPARE_BOUND_S: named after the limit (and the node's reports
# going stale, hang_rules.STALE_S = 5 s), in place some 5 s later (the step's grace, the probe); 12 s leaves a
# loaded step four times the 3 s that was called a hang, and ~10 s of the bound. Factor 2 (the least allowed)
# keeps the limit at min_s unless the median step passes 6 s.
SLOW_HANG = {"min_s": 60, "start_s": 120}
CUT_HANG = {"min_s": 12, "factor": 2, "start_s": 120}


def _network_spec(name: str, workdir: Path, hang: dict) -> dict:
    """One spec for the slow-link and the cut-link runs: 3 step nodes x 1 rank and a spare (the batch host);
    only the hang watchdog's limits differ (SLOW_HANG, CUT_HANG), and they change no loss."""
    spec = training_spec(name, workdir, STEPS, interval=INTERVAL)
    spec["nodes"] = 3
    spec["parallelism"] = {"dp_shard": 3}
    # Link probe on; the local-work factor high enough that load on this shared machine names no rank.
    spec["train"]["stragglers"] = {
        "every_steps": 4,
        "factor": 3.0,
        "windows": 2,
        "link_probe_bytes": LINK_PROBE_BYTES,
    }
    spec["resilience"].update(max_restarts=2, spare_nodes=1, collective_timeout_s=120, hang=hang)
    return spec


def _first_step_after(metrics: Path, starts_before: int) -> dict:
    """The first step record of a run started after the first `starts_before` runs."""
    starts = 0
    for record in (json.loads(line) for line in metrics.read_text().splitlines()):
        starts += record.get("event") == "start"
        if starts > starts_before and "loss" in record:
            return record
    raise AssertionError(f"no step logged after the first {starts_before} runs in {metrics}")


def _run_to_end(job: str, timeout: float = 300):
    return wait_for(lambda: (i := CliBackend().info(job)).state.finished and i, timeout, f"job {job} to end")


@pytest.fixture(scope="module")
def slow_link(cluster, tmp_path_factory) -> dict:
    """node3's link at 1/SLOW_BY of one node-to-node TCP stream: the all-nodes check with pairwise bandwidth, then
    the training spec's run (uninterrupted: the reference losses)."""
    work = tmp_path_factory.mktemp("slow-link")
    for node in NODES:
        devcluster.second_interface(cluster, node)
    size = 20_000_000
    fast_bps = max(size / _transfer_s(cluster, size) for _ in range(3))
    rate = f"{int(fast_bps * 8 / SLOW_BY)}bit"
    devcluster.slow(cluster, SLOW, rate=rate)
    try:
        # Only the interface check on each node (the others import torch there and judge GPUs this machine lacks).
        check = ["check", "--all-nodes", "--only", "socket-ifname"]
        # 6 rounds: every pairing twice, so each node's figure (its best pair's) has two chances at a moment the
        # rest of a loaded 2-core host leaves it; with 3 (one each) a starved healthy node read 3.5x below its
        # peers and was named beside the slow one (a fresh-clone `make test`).
        check += ["--bandwidth", "--bandwidth-rounds", "6", "--bandwidth-size", "4M"]
        checked = subprocess.run(
            [HPKIT, *check, "--json", "--output-dir", str(work / "check"), "--wait-timeout", "240"],
            env=cluster,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
        )
        job = submit(_network_spec("slow", work, SLOW_HANG), work, cluster)
        info = _run_to_end(job)
    finally:
        devcluster.unslow(cluster, SLOW)
    return {"work": work, "rate": rate, "check": checked, "job": job, "info": info}


def test_a_slow_link_is_named_by_the_pairwise_check_and_the_straggler_detector_and_no_other_node(slow_link):
    checked = slow_link["check"]
    report = json.loads(checked.stdout)
    bandwidth = report["bandwidth"]
    assert bandwidth["slow"] == [SLOW], (slow_link["rate"], bandwidth, checked.stderr[-2000:])
    assert report["exclude"] == [SLOW] and checked.returncode == 1, report["exclude"]
    # The slow node was measured again, alone, as many times as a flagged node is, and stayed flagged.
    (pairs,) = (slow_link["work"] / "check").glob("pairs-*.json")
    again = json.loads(pairs.read_text())["confirm"]
    assert sum(SLOW in entry["nodes"] for entry in again) == CONFIRM_TRIES, again
    # Every node has ib0 first and NCCL would take it: the check says so, naming eth0, and excludes no node for it.
    assert report["checks"]["socket-ifname"]["WARN"] == list(NODES), report["checks"]
    for node in NODES:
        detail = report["per_node"][node]["checks"]["socket-ifname"]["detail"]
        assert "NCCL would prefer ib0" in detail and "NCCL_SOCKET_IFNAME==eth0" in detail, detail
    print(f"{SLOW} at {slow_link['rate']}: busbw {bandwidth['busbw_gbps']}")

    info = slow_link["info"]
    log = job_log(info)
    assert info.state == JobState.COMPLETED, log[-6000:]
    placed = events_of(job_events(slow_link["work"] / "logs", slow_link["job"]), "run_started")[0]
    assert SLOW in placed["step_nodes"] and CUT in placed["step_nodes"], placed
    named = re.findall(r"WARNING: straggler: node (\S+)'s links are ([\d.]+)x slower", log)
    assert named and {node for node, _ in named} == {SLOW}, log[-6000:]
    # The local-work detector is the CPU's: on this shared 2-core machine (load 20-30 while the suite runs) it may
    # name a rank that load slowed, which test_stragglers.py tells apart with a control run. Shown, not judged.
    for line in re.findall(r".*WARNING: straggler: rank \d+.*", log):
        print(line)
    assert "hpkit: hang:" not in log, log[-6000:]
    print(f"straggler detector: {SLOW}'s links {', '.join(f + 'x' for _, f in named)} the others' median")


def test_a_cut_node_is_named_and_a_spare_takes_its_place_within_30_s_with_the_reference_losses(
    cluster, slow_link, tmp_path
):
    reference = losses(slow_link["work"] / "slow.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1)), sorted(reference)
    job = submit(_network_spec("cut", tmp_path, CUT_HANG), tmp_path, cluster)
    metrics = tmp_path / "cut.jsonl"
    # The event: every rank has finished step CUT_AT (rank 0 logs a step once its loss is all-reduced). The
    # metrics file is read ten times a second and Slurm asked every two: under load a Slurm call takes seconds,
    # and a poll that waits for it saw step 12 at step 20.
    asked = {"at": 0.0}

    def reached() -> bool:
        if CUT_AT in losses(metrics):
            return True
        if time.monotonic() - asked["at"] >= 2.0:
            asked["at"] = time.monotonic()
            return CliBackend().info(job).state.finished
        return False

    wait_for(reached, 240, f"step {CUT_AT}", poll=0.1)
    starts_before = sum(json.loads(x).get("event") == "start" for x in metrics.read_text().splitlines())
    devcluster.cut(cluster, CUT)
    cut_at = time.time()
    try:
        info = _run_to_end(job)
    finally:
        devcluster.restore(cluster, CUT)
    log = job_log(info)
    assert info.state == JobState.COMPLETED, log[-6000:]
    events = job_events(tmp_path / "logs", job)
    # Named by the watchdog (a verdict naming the node) or, where Slurm's own node-failure call ended the step
    # first, by the supervisor's probe alone: both name the cut node, and only it.
    verdicts = list((tmp_path / "logs" / "hangs").glob(f"{job}-*/verdict.json"))
    for verdict_path in verdicts:
        verdict = json.loads(verdict_path.read_text())
        assert {verdict["nodes"][str(r)] for r in verdict["culprits"]} == {CUT}, verdict
        assert f"node {CUT} froze or is cut off" in verdict["line"], verdict
    (probe, *_) = events_of(events, "probe")
    assert probe["unanswering"] == [CUT], events
    (swap,) = events_of(events, "spare_swap")
    assert (swap["node"], swap["spare"]) == (CUT, "node1"), events
    assert not events_of(events, "requeue") and events_of(events, "end")[-1]["outcome"] == "completed", events

    named_s = (verdicts[0].stat().st_mtime if verdicts else probe["time"]) - cut_at
    print(f"named by {'the watchdog' if verdicts else 'the probe (Slurm ended the step first)'}")
    swapped_s = swap["time"] - cut_at
    next_step = _first_step_after(metrics, starts_before)
    next_step_s = next_step["time"] - cut_at
    print(
        f"cut -> named {named_s:.1f} s, -> spare in place {swapped_s:.1f} s, -> next step {next_step_s:.1f} s"
    )
    assert swapped_s <= SPARE_BOUND_S, f"the spare took {CUT}'s place {swapped_s:.1f} s after the cut"

    got = losses(metrics)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), f"step {step}"


def test_down_removes_every_namespace_veth_and_bridge(cluster):
    assert _links_and_namespaces(), "the cluster's network should be up before down.sh"
    devcluster.down(cluster)
    assert _links_and_namespaces() == ""
    assert not list((Path(cluster["HPKIT_DEV_CLUSTER_DIR"]) / "run").glob("*.pid"))  # netdelay.py's too
