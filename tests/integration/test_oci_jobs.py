"""Jobs inside the CPU image under Slurm, for real: Slurm's OCI containers (runc) on local clusters.

The CPU image is built from this checkout (tests/integration/_image_engine.py) and exported with `hpkit image
export --oci`; every job is submitted with `hpkit submit` to a private 2-node cluster whose oci.conf runs runc
(slurm/dev/up.sh). A 2-node x 2-rank FSDP x TP job runs inside the image and outside it with the same losses;
each rank shows that it ran in the image, with the host's /var/log mounted; the image's start-up check runs
once per node; checkpoints cross between the two ways in both directions. Slurm 24.11 runs the same job with
launcher: srun, a container per rank (22.05 refuses it at submit). A job whose container srun ignores (a cluster
without oci.conf, as pyxis has been seen to do on HyperPod's configless Slurm) stops with one line per node. Skips,
saying why, only where podman or runc cannot run (as the image tests).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _image_engine import shared_bundle
from training_layouts import BASE

from _clusters import slot
from hpkit import devcluster

pytestmark = [pytest.mark.image, pytest.mark.cluster]

SUBMIT_TIMEOUT_S = 600
HPKIT = str(Path(sys.executable).with_name("hpkit"))
IMAGE_ONLY = "/usr/local/bin/hpkit-entrypoint"  # the image's start-up check: the host has none


@pytest.fixture(scope="module")
def bundle(request) -> Path:
    # Exported once per run by whichever module built the image (test_image_build.py, usually): the jobs only
    # read it, so one copy serves both.
    return shared_bundle(request)


def _cluster(tmp_path_factory, name: str, offset: int, **options) -> dict[str, str]:
    """A cluster of the "oci" slot: its ports from `offset` on (a controller and 2 nodes), job ids from 10 x it."""
    if shutil.which("runc") is None:
        pytest.skip("runc cannot run here: not installed (`make image-test-deps` as root installs it)")
    port, first_job_id = slot("oci")
    env = devcluster.client_env(
        tmp_path_factory.mktemp(name), port + offset, first_job_id + 10 * offset, **options
    )
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    try:
        devcluster.up(env)
    except devcluster.DevClusterError as exc:
        pytest.fail(str(exc))
    return env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, str]:
    env = _cluster(tmp_path_factory, "oci-cluster", 0)
    yield env
    devcluster.down(env)


@pytest.fixture(scope="module")
def cluster_24_11(tmp_path_factory) -> dict[str, str]:
    """Slurm 24.11 (HyperPod's): runc from its trixie root (slurm/dev/slurm-root.sh), where the host's /var/log is
    bound too (HPKIT_SLURM_BINDS), so that the job's bundle mounts the host's, as on a real node."""
    env = _cluster(
        tmp_path_factory, "oci-24.11", 6, slurm="24.11", base={**os.environ, "HPKIT_SLURM_BINDS": "/var/log"}
    )
    yield env
    devcluster.down(env)


@pytest.fixture(scope="module")
def cluster_ignoring_containers(tmp_path_factory) -> dict[str, str]:
    """A 22.05 cluster whose slurmds have no oci.conf: srun takes --container and runs the task on the host, saying
    nothing (measured), as srun without pyxis loaded has been seen to do with --container-image on HyperPod."""
    env = _cluster(tmp_path_factory, "oci-ignored", 3)
    state = Path(env["HPKIT_DEV_CLUSTER_DIR"])
    (state / "etc" / "oci.conf").unlink()
    # A slurmd reads oci.conf when it starts: stop this cluster's slurmds, and up.sh starts them again (it keeps
    # the configuration of a running controller, so it writes no new oci.conf).
    for pid_file in (state / "run").glob("slurmd-*.pid"):
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    try:
        devcluster.up(env)
    except devcluster.DevClusterError as exc:
        pytest.fail(str(exc))
    assert not (state / "etc" / "oci.conf").exists()
    yield env
    devcluster.down(env)


@pytest.fixture(scope="module")
def var_log_marker() -> Path:
    """A file in the host's /var/log that a container sees only through the /var/log mount."""
    marker = Path("/var/log") / f"hpkit-oci-test-{secrets.token_hex(4)}"
    marker.write_text(marker.name + "\n")
    yield marker
    marker.unlink(missing_ok=True)


def _spec(jobs: Path, name: str, *, container: dict | None, steps: int = 4, ckpt: str, **extra) -> Path:
    # Every rank in the image says where it runs: a file only the image has, and the marker in the host's /var/log.
    # Outside, hpkit train itself: the host has neither to show, and its ranks fork warm (a bash command's start cold).
    probe = (
        f'echo "WHERE rank=$RANK image=$(test -x {IMAGE_ONLY} && echo yes || echo no) '
        'var_log=$(cat /var/log/$HPKIT_MARKER 2>/dev/null || echo none)"; exec hpkit train'
    )
    spec = {
        "name": name,
        "nodes": 2,
        "tasks_per_node": 2,
        "output_dir": str(jobs / "out"),
        # Not on EC2: the start-up check's metadata service check is off, as in the image tests.
        "env": {"AWS_EC2_METADATA_DISABLED": "true", "HPKIT_MARKER": extra.pop("marker", "none")},
        "command": ["bash", "-c", probe]
        if container is not None
        else [sys.executable, "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": 2, "tp": 2},
        "model": BASE["model"],
        "train": {**BASE["train"], "steps": steps, "local_batch_size": 2},
        "checkpoint": {"dir": str(jobs / ckpt), "interval": 2, "keep": 3},
        **extra,
    }
    if container is not None:
        spec["container"] = container
    path = jobs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _submit(env: dict[str, str], spec: Path) -> tuple[int, str, str]:
    """`hpkit submit SPEC --wait`: (exit status, what it printed, the job's output)."""
    done = subprocess.run(
        [HPKIT, "submit", str(spec), "--wait", "--poll", "0.5"],
        env=env,
        cwd=spec.parent,
        capture_output=True,
        text=True,
        timeout=SUBMIT_TIMEOUT_S,
    )
    printed = done.stdout + done.stderr
    found = re.search(r"^  output: (\S+)$", done.stdout, re.M)
    log = Path(found.group(1)).read_text() if found and Path(found.group(1)).is_file() else ""
    return done.returncode, printed, log


def _losses(jobs: Path, name: str) -> dict[int, float]:
    files = list((jobs / "out").glob(f"{name}-[0-9]*.metrics.jsonl"))
    assert len(files) == 1, files
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "event" not in r}


def _reference_losses(jobs: tuple[Path, dict[str, tuple]]) -> dict[int, float]:
    """The losses of torchrun's job outside the image, which the other jobs must equal: checked here, since a test
    comparing with them may run without the test that checks that job."""
    folder, ran = jobs
    status, printed, log = ran["out"]
    assert status == 0, f"out: {printed}\n{log}"
    losses = _losses(folder, "out")
    assert sorted(losses) == [1, 2, 3, 4], losses
    return losses


@pytest.fixture(scope="module")
def jobs(cluster, bundle: Path, var_log_marker: Path, tmp_path_factory) -> tuple[Path, dict[str, tuple]]:
    """Inside and outside the image, then each resuming the other's checkpoint."""
    jobs = tmp_path_factory.mktemp("oci-jobs")
    container = {
        "runtime": "oci",
        "image": str(bundle),
        "mounts": [f"{jobs}:{jobs}"],
        "startup_check": "fail",
    }
    marker = var_log_marker.name
    ran = {}
    ran["in"] = _submit(cluster, _spec(jobs, "in", container=container, ckpt="ckpt-in", marker=marker))
    ran["out"] = _submit(cluster, _spec(jobs, "out", container=None, ckpt="ckpt-out"))
    # Each resumes the other's step-4 checkpoint and trains to step 6.
    shutil.copytree(jobs / "ckpt-out", jobs / "ckpt-in-from-out")
    shutil.copytree(jobs / "ckpt-in", jobs / "ckpt-out-from-in")
    ran["in-from-out"] = _submit(
        cluster, _spec(jobs, "in-from-out", container=container, steps=6, ckpt="ckpt-in-from-out")
    )
    ran["out-from-in"] = _submit(
        cluster, _spec(jobs, "out-from-in", container=None, steps=6, ckpt="ckpt-out-from-in")
    )
    return jobs, ran


def test_fsdp_tp_job_in_the_image_matches_the_same_job_outside(jobs, var_log_marker: Path) -> None:
    assert not Path(IMAGE_ONLY).exists(), f"the host has {IMAGE_ONLY}: it cannot tell the image apart"
    folder, ran = jobs
    for name in ("in", "out"):
        status, printed, log = ran[name]
        assert status == 0, f"{name}: {printed}\n{log}"
    inside = re.findall(r"WHERE rank=(\d) image=(\w+) var_log=(\S+)", ran["in"][2])
    assert sorted(inside) == [(str(r), "yes", var_log_marker.name) for r in range(4)], ran["in"][2]
    losses_in, losses_out = _losses(folder, "in"), _losses(folder, "out")
    assert sorted(losses_in) == [1, 2, 3, 4]
    assert losses_in == pytest.approx(losses_out, rel=1e-6, abs=0)


def test_checkpoints_cross_between_inside_and_outside_both_ways(jobs) -> None:
    folder, ran = jobs
    for name in ("in-from-out", "out-from-in"):
        status, printed, log = ran[name]
        assert status == 0, f"{name}: {printed}\n{log}"
    from_out, from_in = _losses(folder, "in-from-out"), _losses(folder, "out-from-in")
    # Both resumed the step-4 checkpoint (equal in both, as the losses so far were): steps 5 and 6 only.
    assert sorted(from_out) == [5, 6] and sorted(from_in) == [5, 6], (from_out, from_in)
    assert from_out == pytest.approx(from_in, rel=1e-6, abs=0)


def test_start_up_check_runs_once_per_node_fails_without_var_log_and_warn_goes_on(
    cluster, bundle: Path, tmp_path: Path
) -> None:
    container = {"runtime": "oci", "image": str(bundle), "mounts": [f"{tmp_path}:{tmp_path}"]}
    container["mount_var_log"] = False
    spec = _spec(tmp_path, "check-fail", container={**container, "startup_check": "fail"}, ckpt="ckpt-fail")
    status, printed, log = _submit(cluster, spec)
    assert status != 0, log
    assert "WHERE rank=" not in log, "the ranks started although the check failed"
    assert re.search(r"^FAIL\s+var-log-mount\s+.*not the host's", log, re.M), log
    # The same report: the container saw a root other than the host's (hpkit check's in-image, through the image's
    # start-up check; the host side is test_a_container_srun_ignores_stops_the_job_with_one_line_per_node).
    assert re.search(r"^PASS\s+in-image\s+in the image \(", log, re.M), log
    assert "hpkit-entrypoint: the container start-up check failed" in log, log

    spec = _spec(tmp_path, "check-warn", container={**container, "startup_check": "warn"}, ckpt="ckpt-warn")
    spec_data = yaml.safe_load(spec.read_text())
    spec_data["train"]["steps"] = 1
    spec.write_text(yaml.safe_dump(spec_data))
    status, printed, log = _submit(cluster, spec)
    assert status == 0, f"{printed}\n{log}"
    # Once per node (2 nodes), not once per rank (4).
    assert log.count("hpkit-entrypoint: warning:") == 2, log
    assert len(re.findall(r"WHERE rank=\d image=yes var_log=none", log)) == 4, log


def test_bad_container_input_is_one_line_naming_the_field_before_submitting(
    cluster, bundle: Path, tmp_path: Path
) -> None:
    not_a_bundle = tmp_path / "not-a-bundle"
    not_a_bundle.mkdir()
    cases = {
        "missing": ({"image": str(tmp_path / "no-such-bundle")}, "container.image"),
        "not-a-bundle": ({"image": str(not_a_bundle)}, "container.image"),
        "mount": ({"image": str(bundle), "mounts": [f"{tmp_path}/absent:/data"]}, "container.mounts"),
        "srun": ({"image": str(bundle)}, "launcher"),
        # 22.05 gives every container task 0's SLURMD_NODENAME: no node's zygote could be found.
        "warm": ({"image": str(bundle)}, "resilience.warm_start"),
    }
    per_case = {"srun": {"launcher": "srun"}, "warm": {"resilience": {"warm_start": True}}}
    for case, (container, field) in cases.items():
        extra = per_case.get(case, {})
        spec = _spec(tmp_path, case, container={"runtime": "oci", **container}, ckpt="c", **extra)
        status, printed, _ = _submit(cluster, spec)
        lines = printed.strip().splitlines()
        assert status != 0 and len(lines) == 1, f"{case}: {printed}"
        assert field in lines[0] and "submitted job" not in printed, f"{case}: {printed}"
        assert not (tmp_path / "out").exists(), f"{case}: files were written before the check"


def test_a_container_srun_ignores_stops_the_job_with_one_line_per_node(
    cluster_ignoring_containers, cluster, bundle: Path, tmp_path: Path
) -> None:
    container = {
        "runtime": "oci",
        "image": str(bundle),
        "mounts": [f"{tmp_path}:{tmp_path}"],
        "startup_check": "fail",
    }
    status, printed, log = _submit(
        cluster_ignoring_containers, _spec(tmp_path, "ignored", container=container, ckpt="c")
    )
    assert status != 0, f"{printed}\n{log}"
    assert "WHERE rank=" not in log, "the program ran on the host"
    lines = re.findall(
        r"^hpkit: (node\d): this task runs on the host, not in container.image (\S+): (.*)$", log, re.M
    )
    assert sorted(n for n, _, _ in lines) == ["node1", "node2"], log
    assert all(image == str(bundle) and "oci.conf beside slurm.conf" in fix for _, image, fix in lines), log
    # `hpkit check` (login profile) says the same before any job: one task on the host, one in the image.
    for env, verdict in ((cluster_ignoring_containers, "FAIL"), (cluster, "PASS")):
        check = subprocess.run(
            [HPKIT, "check", "--only", "container-runs", "--plain"],
            env={**env, "HPKIT_CHECK_IMAGE": f"oci:{bundle}"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        line = next((x for x in check.stdout.splitlines() if "container-runs" in x), "")
        assert line.startswith(verdict), check.stdout + check.stderr
        assert bool(re.search(r"node\d's host, not in the image", line)) == (verdict == "FAIL"), line


# The same report as _spec's bash probe, from a Python program (a bash command's ranks start cold), then hpkit train.
WARM_PROBE = f"""
import os, runpy, sys
try:
    with open("/var/log/" + os.environ["HPKIT_MARKER"]) as marker:
        var_log = marker.read().strip()
except OSError:
    var_log = "none"
image = "yes" if os.access("{IMAGE_ONLY}", os.X_OK) else "no"
print(f"WHERE rank={{os.environ['RANK']}} image={{image}} var_log={{var_log}}", flush=True)
sys.argv = ["hpkit", "train", *sys.argv[1:]]
runpy.run_module("hpkit", run_name="__main__")
"""


def test_ranks_fork_warm_in_their_node_s_container_on_24_11(
    cluster_24_11, jobs, bundle: Path, var_log_marker: Path, tmp_path: Path
) -> None:
    """resilience.warm_start in Slurm's own OCI containers: each node's zygote runs in the image (its step has the
    job's containers too), and every rank forks from it, in the image with the host's /var/log, to the losses of
    torchrun's job outside it. 22.05 gives every container task 0's variables and is refused at submit (test_warm)."""
    probe = tmp_path / "probe.py"
    probe.write_text(WARM_PROBE)
    container = {"runtime": "oci", "image": str(bundle), "mounts": [f"{tmp_path}:{tmp_path}"]}
    marker = var_log_marker.name
    spec = _spec(
        tmp_path,
        "warm-in",
        container=container,
        ckpt="ckpt",
        marker=marker,
        command=["python3", str(probe)],
        resilience={"warm_start": True},
    )
    status, printed, log = _submit(cluster_24_11, spec)
    assert status == 0, f"{printed}\n{log}"
    assert re.search(r"^hpkit: warm starts: every zygote serves after ", log, re.M), log
    forked = re.findall(r"^hpkit: warm start on node\d: rank (\d) \(attempt 0\) forked as process", log, re.M)
    assert sorted(forked) == ["0", "1", "2", "3"], log
    inside = re.findall(r"WHERE rank=(\d) image=(\w+) var_log=(\S+)", log)
    assert sorted(inside) == [(str(r), "yes", marker) for r in range(4)], log
    assert _losses(tmp_path, "warm-in") == pytest.approx(_reference_losses(jobs), rel=1e-6, abs=0)


def test_srun_launcher_runs_a_container_per_rank_on_24_11(
    cluster_24_11, jobs, bundle: Path, var_log_marker: Path, tmp_path: Path
) -> None:
    """Slurm 24.11 runs a container per task, several per node: launcher: srun (4 ranks, 2 a node) inside the
    image gives the losses of torchrun's job outside it (22.05 refuses it at submit: the bad-input test)."""
    container = {
        "runtime": "oci",
        "image": str(bundle),
        "mounts": [f"{tmp_path}:{tmp_path}"],
        "startup_check": "fail",
    }
    marker = var_log_marker.name
    spec = _spec(tmp_path, "srun-in", container=container, ckpt="ckpt", launcher="srun", marker=marker)
    status, printed, log = _submit(cluster_24_11, spec)
    assert status == 0, f"{printed}\n{log}"
    inside = re.findall(r"WHERE rank=(\d) image=(\w+) var_log=(\S+)", log)
    assert sorted(inside) == [(str(r), "yes", marker) for r in range(4)], log
    assert log.count("hpkit-entrypoint:") == 2, log  # the start-up check once per node
    assert _losses(tmp_path, "srun-in") == pytest.approx(_reference_losses(jobs), rel=1e-6, abs=0)
