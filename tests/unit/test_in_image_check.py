"""The container profile's in-image check and the job's task-level guard: a task that sees the host's root is not in
its image (srun has been seen to ignore --container-image silently; Slurm 22.05 ignores --container without oci.conf).
The real jobs, in and out of an image, are in tests/integration/test_oci_jobs.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpkit.checks import container
from hpkit.checks.context import Context, Roots
from hpkit.checks.result import Status
from hpkit.slurm.job import ContainerSpec
from hpkit.slurm.script import in_image_step


def root_id(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


def ctx_in(tree: Path, host_root: str | None) -> Context:
    (tree / "etc").mkdir(parents=True, exist_ok=True)
    (tree / "etc" / "os-release").write_text('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n')
    env = {"PATH": "/usr/bin:/bin"} | ({container.HOST_ROOT_VAR: host_root} if host_root is not None else {})
    return Context(profile="container", roots=Roots.under(tree), env=env)


def test_the_hosts_own_root_fails_in_one_line_with_the_fix(tmp_path: Path) -> None:
    result = container.in_image(ctx_in(tmp_path, root_id(tmp_path)))
    assert result.status is Status.FAIL and "the root file system is the host's" in result.detail
    assert (
        "Ubuntu 22.04.4 LTS" in result.detail
        and "--container-image" in result.fix
        and "oci.conf" in result.fix
    )
    assert "\n" not in result.detail + result.fix


def test_another_root_is_the_image(tmp_path: Path) -> None:
    result = container.in_image(ctx_in(tmp_path, root_id(Path("/"))))
    assert result.status is Status.PASS and "in the image (Ubuntu 22.04.4 LTS" in result.detail


def test_without_the_hosts_word_it_cannot_tell(tmp_path: Path) -> None:
    assert container.in_image(ctx_in(tmp_path, None)).status is Status.SKIP


@pytest.mark.parametrize("mode", ["fail", "warn"])
def test_task_guard_on_the_host_and_in_another_root(tmp_path: Path, mode: str) -> None:
    """The shell each task runs first (hpkit.slurm.script.in_image_step), run here: with HPKIT_HOST_ROOT this machine's root
    (the task is on the host) it prints one line naming the image and the fix, and stops unless warn."""
    step = in_image_step(ContainerSpec(image="nvcr.io#nvidia/pytorch:24.07-py3", startup_check=mode))
    script = f"{step}; echo GOT-TO-THE-PROGRAM"

    def run(host_root: str, local_id: str = "0") -> subprocess.CompletedProcess:
        env = {
            "PATH": "/usr/bin:/bin",
            "HPKIT_HOST_ROOT": host_root,
            "SLURM_LOCALID": local_id,
            "SLURMD_NODENAME": "n7",
        }
        return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)

    on_host = run(root_id(Path("/")))
    lines = on_host.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "n7: this task runs on the host, not in container.image nvcr.io#nvidia/pytorch" in lines[0]
    )
    assert "pyxis options" in lines[0] and "spank_pyxis.so" in lines[0]
    if mode == "fail":
        assert on_host.returncode == 1 and "GOT-TO-THE-PROGRAM" not in on_host.stdout
        assert run(root_id(Path("/")), local_id="1").stderr == ""  # one line per node: its first task's
    else:
        assert on_host.returncode == 0 and "GOT-TO-THE-PROGRAM" in on_host.stdout and "warning" in lines[0]
    oci = in_image_step(ContainerSpec(runtime="oci", image="/b", startup_check=mode))
    assert "oci.conf beside slurm.conf" in oci and "pyxis" not in oci
    elsewhere = run(root_id(tmp_path))
    assert elsewhere.returncode == 0 and elsewhere.stderr == "" and "GOT-TO-THE-PROGRAM" in elsewhere.stdout


def test_login_check_runs_only_when_given_an_image() -> None:
    """hpkit check's container-runs (login profile) submits two one-task jobs: only when HPKIT_CHECK_IMAGE names the
    image (tests/integration/test_oci_jobs.py runs it on a cluster that ignores containers and one that does not)."""
    from hpkit.checks import slurm

    result = slurm.container_runs(Context(profile="login", env={"PATH": "/nonexistent"}))
    assert result.status is Status.SKIP and "HPKIT_CHECK_IMAGE=IMAGE" in result.fix
