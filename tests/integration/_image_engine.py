"""The image tests' container engine, shared by test_image_build.py and test_oci_jobs.py.

A podman service of the test's own (socket, config and image storage under the test's TMPDIR), the base image
made with mmdebstrap from Debian's mirror (no registry is reachable here; the tarball is cached across runs),
and the CPU image built from this checkout with `hpkit image build --cpu`. The fixtures are module-scoped:
a test module imports the ones it uses (`from _image_engine import base_image, cpu_image, engine`).

The image is built once per test run, not once per module: the build (minutes) also exports the image as an OCI
bundle into the run's pytest base temp (`shared_bundle`), under a lock that the pytest-xdist workers share, so
that test_oci_jobs.py, which needs only the bundle, waits for it instead of starting a podman service and
building the same image a second time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpkit import image
from hpkit.commands import image as image_command

REPO = Path(__file__).resolve().parents[2]
BASE_TAG = "hpkit-base:bookworm"
CACHE = Path(os.environ.get("HPKIT_IMAGE_CACHE") or Path.home() / ".cache" / "hpkit")


@dataclass(frozen=True)
class Engine:
    host: str
    state: Path
    env: dict[str, str]  # for the podman CLI: the same config and storage as the service
    client: object


def unusable_reason() -> str | None:
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        return (
            f"podman cannot run here: {' '.join(missing)} not installed "
            f"(`make image-test-deps` as root installs them: apt-get install {' '.join(missing)})"
        )
    if os.geteuid() != 0:
        return "podman cannot run here: the image tests need root (rootful podman, mmdebstrap root mode)"
    return None


def unmount_under(folder: Path) -> None:
    # A container that died mid-run can leave overlay mounts, and a mounted folder cannot be removed.
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    points = [line.split()[4] for line in lines if line.split()[4].startswith(str(folder) + "/")]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


def remove_in_background(folder: Path) -> None:
    """The engine's storage (2.4 GB, the image's layers) takes about a minute to delete on this machine's ext4
    with online discard: the unlinks wait on the disk, not on a CPU. A detached `rm` does that while the tests
    go on; the folder is inside the run's TMPDIR, which the next `make test` clears anyway."""
    if shutil.which("ionice") is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    subprocess.Popen(
        ["ionice", "-c", "3", "rm", "-rf", str(folder)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    reason = unusable_reason()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("podman")
    if len(str(state / "podman.sock")) > 100:  # AF_UNIX paths are limited to 108 bytes
        state = Path(tempfile.mkdtemp(prefix="hpkit-podman-"))
    env = dict(os.environ, HPKIT_PODMAN_OWN_STORAGE="1")
    script = str(REPO / "scripts/podman-service.sh")
    start = subprocess.run(
        [script, "start", str(state)], env=env, capture_output=True, text=True, timeout=120
    )
    if start.returncode != 0:
        pytest.fail(f"podman's Docker API service did not start:\n{start.stdout}{start.stderr}")
    host = f"unix://{state}/podman.sock"
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = host
    cli_env = dict(
        os.environ,
        CONTAINERS_CONF=str(state / "containers.conf"),
        CONTAINERS_STORAGE_CONF=str(state / "storage.conf"),
    )
    try:
        yield Engine(host, state, cli_env, image.connect())
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
        subprocess.run([script, "stop", str(state)], env=env, capture_output=True, timeout=120)
        unmount_under(state)
        remove_in_background(state)


@pytest.fixture(scope="module")
def base_image(engine: Engine) -> str:
    recipe = (REPO / "docker/mkbase.sh").read_bytes() + Path(
        "/etc/ssl/certs/ca-certificates.crt"
    ).read_bytes()
    tarball = CACHE / f"base-bookworm-{hashlib.sha256(recipe).hexdigest()[:12]}.tar"
    if not tarball.is_file():
        started = time.monotonic()
        made = subprocess.run(
            [str(REPO / "docker/mkbase.sh"), str(tarball), "bookworm"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if made.returncode != 0:
            pytest.fail(
                f"mmdebstrap could not make the base image:\n{made.stdout[-3000:]}{made.stderr[-3000:]}"
            )
        print(f"base tarball made in {time.monotonic() - started:.0f} s")
    image.import_base(engine.client, tarball, BASE_TAG)
    return BASE_TAG


def _shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test run's folder for the image, which its xdist workers share: pytest's base temp of the run (a worker's
    is a folder in it), new for every run and pruned with pytest's older runs. The bundle is built from this
    checkout: it must not outlive the run, or a later run (`pytest` straight, with TMPDIR=/tmp) would test stale code."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-cpu-image"
    shared.mkdir(exist_ok=True)
    return shared


@contextmanager
def _build_lock(shared: Path) -> Iterator[None]:
    """Held while one worker builds and exports: another worker's module waits rather than builds too."""
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def cpu_image(engine: Engine, base_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    shared = _shared(tmp_path_factory)
    with _build_lock(shared):
        started = time.monotonic()
        code = image_command.main(
            ["image", "build", "--cpu", "--quiet", "--base-image", base_image, "--context", str(REPO)]
        )
        assert code == 0
        print(f"CPU image built in {time.monotonic() - started:.0f} s")
        if not (shared / "exported").exists():
            started = time.monotonic()
            code = image_command.main(["image", "export", "--oci", str(shared / "hpkit-cpu"), "hpkit:cpu"])
            assert code == 0
            (shared / "exported").touch()
            print(f"CPU image exported as an OCI bundle in {time.monotonic() - started:.0f} s")
    return "hpkit:cpu"


def shared_bundle(request: pytest.FixtureRequest) -> Path:
    """The CPU image as an OCI bundle: the one this run has exported (waiting while a worker builds it), else
    built here (this module's own podman service) and exported by `cpu_image`."""
    shared = _shared(request.getfixturevalue("tmp_path_factory"))
    with _build_lock(shared):
        if (shared / "exported").exists():
            return shared / "hpkit-cpu"
    request.getfixturevalue("cpu_image")
    assert (shared / "exported").exists()
    return shared / "hpkit-cpu"
