"""hpkit.image without an engine: versions, build args, tags, the build log, the wheelhouse, the no-engine line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpkit import __version__, image

REPO = Path(__file__).resolve().parents[2]


def test_versions_file_parses_and_pins_torch() -> None:
    versions = image.read_versions(REPO / image.VERSIONS_FILE)
    assert versions["TORCH_VERSION"] == "2.13.0"  # pyproject's train extra pins the same
    assert all(value and " " not in value for value in versions.values())


@pytest.mark.parametrize(
    ("line", "why"),
    [("torch=2.13", "upper-case"), ("TORCH_VERSION", "KEY=VALUE"), ('A="1"', "plain"), ("A=$B", "plain")],
)
def test_versions_file_rejects_what_it_cannot_pass_literally(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "versions.env"
    path.write_text(f"# comment\n\n{line}\n")
    with pytest.raises(image.ImageError, match=r"versions.env:3: expected KEY=VALUE"):
        image.read_versions(path)


def test_versions_file_rejects_a_key_set_twice(tmp_path: Path) -> None:
    path = tmp_path / "versions.env"
    path.write_text("A=1\nA=2\n")
    with pytest.raises(image.ImageError, match="A is set twice"):
        image.read_versions(path)


def test_build_args_are_the_declared_versions_plus_hpkit_version() -> None:
    dockerfile = "ARG DEBIAN_RELEASE\nFROM x\nARG TORCH_VERSION\narg HPKIT_VERSION=unknown\n"
    versions = {"DEBIAN_RELEASE": "bookworm", "TORCH_VERSION": "2.13.0", "CUDA_VERSION": "13.0.1"}
    args = image.build_args(dockerfile, versions, {"TORCH_VERSION": "2.13.1"})
    assert args == {"DEBIAN_RELEASE": "bookworm", "TORCH_VERSION": "2.13.1", "HPKIT_VERSION": __version__}


def test_a_build_arg_the_dockerfile_does_not_declare_is_refused() -> None:
    with pytest.raises(image.ImageError, match="declares no ARG NOPE"):
        image.build_args("FROM x\nARG A\n", {}, {"NOPE": "1"})


def test_tags_name_the_versions() -> None:
    versions = {"TORCH_VERSION": "2.13.0", "CUDA_VERSION": "13.0.1", "NCCL_VERSION": "2.29.7-1"}
    assert image.image_tags(image.VARIANTS["gpu"], versions) == [
        f"hpkit:{__version__}-torch2.13.0-cuda13.0.1-nccl2.29.7",
        "hpkit:latest",
    ]
    assert image.image_tags(image.VARIANTS["cpu"], versions, "me/hpkit") == [
        f"me/hpkit:{__version__}-torch2.13.0-cpu",
        "me/hpkit:cpu",
    ]


# Streams as the engines send them (decoded JSON chunks), trimmed.
DOCKER_FAIL = [
    {"stream": "Step 1/3 : FROM debian:bookworm-slim\n"},
    {"stream": " ---> 1a2b3c4d5e6f\n"},
    {"stream": "Step 2/3 : RUN ls /no-such-dir\n"},
    {"stream": " ---> Running in 0f1e2d3c4b5a\n"},
    {"stream": "ls: cannot access '/no-such-"},
    {"stream": "dir': No such file or directory\n"},
    {
        "errorDetail": {
            "code": 2,
            "message": "The command '/bin/sh -c ls /no-such-dir' returned a non-zero code: 2",
        },
        "error": "The command '/bin/sh -c ls /no-such-dir' returned a non-zero code: 2",
    },
]
PODMAN_FAIL = [
    {"stream": "[1/2] STEP 1/2: FROM localhost/hpkit-base:bookworm AS base\n"},
    {"stream": "[2/2] STEP 1/3: FROM base\n"},
    {"stream": "[2/2] STEP 2/3: RUN ls /no-such-dir\n"},
    {"stream": "ls: cannot access '/no-such-dir': No such file or directory\n"},
    {
        "error": 'building at STEP "RUN ls /no-such-dir": while running runtime: exit status 2',
        "errorDetail": {
            "message": 'building at STEP "RUN ls /no-such-dir": while running runtime: exit status 2'
        },
    },
]


def test_docker_build_failure_is_one_line_naming_the_step_and_its_output() -> None:
    log = image.BuildLog()
    shown = [line for chunk in DOCKER_FAIL for line in log.feed(chunk)]
    assert "ls: cannot access '/no-such-dir': No such file or directory" in shown
    failure = log.failure()
    assert "\n" not in failure
    assert failure.startswith("the build failed at step 2/3 (RUN ls /no-such-dir): The command")
    assert failure.endswith("last output: ls: cannot access '/no-such-dir': No such file or directory")


def test_podman_build_failure_keeps_the_engines_step_and_adds_the_output() -> None:
    log = image.BuildLog()
    for chunk in PODMAN_FAIL:
        log.feed(chunk)
    assert log.step == ("stage 2/2 step 2/3", "RUN ls /no-such-dir")
    assert log.failure() == (
        'the build failed: building at STEP "RUN ls /no-such-dir": while running runtime: exit status 2; '
        "last output: ls: cannot access '/no-such-dir': No such file or directory"
    )


def test_build_log_finds_the_image_id_from_either_engine() -> None:
    docker_log = image.BuildLog()
    docker_log.feed({"stream": "Successfully built 1a2b3c4d5e6f\n"})
    assert docker_log.image_id == "1a2b3c4d5e6f"
    podman_log = image.BuildLog()
    podman_log.feed({"aux": {"ID": "sha256:abc"}})
    assert podman_log.image_id == "sha256:abc" and podman_log.error is None


def _fake_wheel(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"PK")
    return path


def test_the_cpu_wheel_is_linked_into_the_wheelhouse_and_strays_removed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(image.platform, "machine", lambda: "x86_64")
    links = tmp_path / "links"
    _fake_wheel(
        links, "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    )  # PyPI's CUDA build: not this one
    wanted = _fake_wheel(links, "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    _fake_wheel(links, "torch-2.13.0+cpu-cp313-cp313-manylinux_2_28_x86_64.whl")
    stray = _fake_wheel(tmp_path / image.WHEELHOUSE, "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    staged = image.stage_torch_wheel(tmp_path, "2.13.0", "bookworm", search=[links])
    assert staged == tmp_path / image.WHEELHOUSE / wanted.name
    assert staged.stat().st_ino == wanted.stat().st_ino  # a hard link: no 180 MB copy
    assert not stray.exists()
    assert image.stage_torch_wheel(tmp_path, "2.13.0", "bookworm", search=[]) == staged  # already there


def test_no_cpu_wheel_anywhere_gives_none(tmp_path: Path) -> None:
    assert image.stage_torch_wheel(tmp_path, "2.13.0", "bookworm", search=[tmp_path]) is None
    with pytest.raises(image.ImageError, match="DEBIAN_RELEASE=sid"):
        image.stage_torch_wheel(tmp_path, "2.13.0", "sid", search=[])


def test_find_links_come_from_the_environment_and_pip_config(tmp_path: Path, monkeypatch) -> None:
    env_dir, conf_dir = tmp_path / "env", tmp_path / "conf"
    env_dir.mkdir()
    conf_dir.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {conf_dir}\n")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{env_dir} {tmp_path / 'missing'}")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    found = image._find_links()
    assert env_dir in found and conf_dir in found and tmp_path / "missing" not in found


def test_the_build_context_leaves_out_local_state() -> None:
    from docker.utils.build import exclude_paths

    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    kept = exclude_paths(str(REPO), patterns, dockerfile="docker/Dockerfile.cpu")
    assert {"pyproject.toml", "python/hpkit/image.py", "docker/entrypoint.sh"} <= kept
    for local in (".venv", ".git", ".test-tmp", ".dev-cluster", "tests", "logs"):
        assert not any(path == local or path.startswith(local + "/") for path in kept), local
    assert not any("__pycache__" in path for path in kept)


def test_no_engine_is_one_line_with_how_to_start_one(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(image.EngineUnavailable) as err:
        image.connect(timeout=2)
    message = str(err.value)
    assert "\n" not in message
    assert f"DOCKER_HOST=unix://{tmp_path}/nothing.sock" in message
    assert "scripts/podman-service.sh start" in message and "export DOCKER_HOST=" in message
    assert "start Docker" in message


def test_hpkit_image_build_without_an_engine_says_so_in_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, DOCKER_HOST=f"unix://{tmp_path}/nothing.sock", PYTHONPATH=str(REPO / "python"))
    run = subprocess.run(
        [sys.executable, "-m", "hpkit", "image", "build"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stderr
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("hpkit image: error: no container engine answers at DOCKER_HOST=")
    assert "podman-service.sh start" in lines[0]
