"""`hpkit check` and scripts/check-prereqs.sh end to end on this machine, in fresh processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check-prereqs.sh"
# What a login node's check must never import: each costs a second or more there, and none is needed.
HEAVY_MODULES = ("torch", "numpy", "pydantic", "jinja2", "rich", "yaml")


# The rows of the login profile, as both ways of running it (hpkit check, the system-Python script) print them.
LOGIN_CHECKS = {
    "python",
    "imds",
    "slurm",
    "topology",
    "pyxis",
    "container-runs",
    "enroot",
    "shared-fs",
    "disk",
}


def _closed_port() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def env() -> dict[str, str]:
    # Never the real 169.254.169.254: the probe goes to a closed local port instead, which it reports.
    # Nor another test's Slurm cluster: the session cluster's SLURM_CONF is in os.environ while it is up.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_EC2_METADATA", "PYTHON", "SLURM"))}
    return {**clean, "AWS_EC2_METADATA_SERVICE_ENDPOINT": _closed_port(), "PYTHONPATH": str(REPO / "python")}


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python with the standard library only: what a login node has before anything is installed."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    for module in ("rich", "torch", "pydantic", "jinja2"):
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=30)
        assert probe.returncode != 0, f"{module} is importable in the bare venv"
    return python


def _verdicts(stdout: str) -> dict[str, str]:
    return {row["name"]: row["status"] for row in json.loads(stdout)["checks"]}


def test_login_profile_end_to_end_imports_nothing_heavy(env: dict[str, str]) -> None:
    """The login profile's verdicts, from a fresh process that imports only the standard library and hpkit.

    Its wall time is a benchmark (bench/bench_check.py), not a test: this machine is shared.
    """
    argv = [sys.executable, "-X", "importtime", "-m", "hpkit", "check", "--profile", "login", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode in (0, 1), done.stderr
    verdicts = _verdicts(done.stdout)
    assert set(verdicts) == LOGIN_CHECKS
    # This Python passes; the endpoint is a closed port, which a login node only warns about.
    assert verdicts["python"] == "PASS" and verdicts["imds"] == "WARN", verdicts
    assert done.returncode == (1 if "FAIL" in verdicts.values() else 0)
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "hpkit.checks.context" in imported, "importtime printed nothing: the check below would see nothing"
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY_MODULES)
    assert not heavy, f"the login profile imports {heavy}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--profile", "login"],
        # torch, CUDA and NCCL are read from the Python environment, which differs on purpose here.
        ["--profile", "compute", "--skip", "torch,cuda,nccl"],
        ["--profile", "container", "--skip", "torch,cuda,nccl"],
    ],
)
def test_script_without_the_package_gives_the_same_verdicts(
    argv: list[str], env: dict[str, str], bare_python: str
) -> None:
    installed = subprocess.run(
        [sys.executable, "-m", "hpkit", "check", *argv, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    script_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    script_env["PYTHON"] = bare_python
    script = subprocess.run(
        [str(SCRIPT), *argv, "--json"], env=script_env, capture_output=True, text=True, timeout=30, cwd="/"
    )
    assert script.returncode == installed.returncode, script.stderr
    verdicts = _verdicts(installed.stdout)
    assert _verdicts(script.stdout) == verdicts
    # Equal verdicts prove little if both sides are broken alike: pin the ones known here.
    assert verdicts["python"] == "PASS", verdicts
    assert verdicts["imds"] == ("WARN" if argv[1] == "login" else "FAIL"), verdicts
    assert installed.returncode == (1 if "FAIL" in verdicts.values() else 0)


def test_script_plain_output_and_usage_error(env: dict[str, str], bare_python: str, tmp_path: Path) -> None:
    script_env = {**env, "PYTHON": bare_python}
    link = tmp_path / "check-prereqs"
    link.symlink_to(SCRIPT)  # people link it into ~/bin
    done = subprocess.run(
        [str(link), "--only", "python"], env=script_env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and done.stdout.startswith("PASS  python"), done.stderr
    bad = subprocess.run(
        [str(SCRIPT), "--only", "nope"], env=script_env, capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "unknown check" in bad.stderr


def test_script_runs_on_the_system_python_with_no_venv(tmp_path: Path) -> None:
    """A fresh login node: the distribution's python3 on a bare PATH, no venv, nothing else in the environment."""
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is None:
        pytest.skip("no system python3 in /usr/bin or /bin")
    clean = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": _closed_port(),
    }
    done = subprocess.run(
        [str(SCRIPT), "--json"], env=clean, capture_output=True, text=True, timeout=30, cwd="/"
    )
    assert done.returncode in (0, 1), done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)["checks"]}
    assert set(rows) == LOGIN_CHECKS
    assert rows["python"]["detail"].endswith(f" at {system}"), rows["python"]
    assert done.returncode == (1 if any(r["status"] == "FAIL" for r in rows.values()) else 0)


def test_script_without_python(env: dict[str, str]) -> None:
    done = subprocess.run(
        [str(SCRIPT)],
        env={**env, "PYTHON": "/nonexistent/python3"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1 and "PYTHON=" in done.stderr


def test_script_passes_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
