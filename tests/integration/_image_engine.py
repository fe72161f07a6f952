"""The image tests' container engine and CPU image, built ONCE per test run for test_image_build.py and test_oci_jobs.py.

A podman service of the tests' own (socket, config and image storage in one folder of the run's temporary
directory), the base image made with mmdebstrap from Debian's mirror (no registry is reachable here; the tarball is
cached across runs), and the CPU image built from this checkout with `hpkit image build --cpu`.

Why shared: the build takes minutes and both modules need the same image, usually at the same time on different
xdist workers (`make test` runs `-n 3 --dist loadfile`). So the image is made once per run, by whichever module asks
first, in a folder all workers of the run share (the run's basetemp, `shared_folder`), under a file lock:

- test_image_build.py's `engine` starts the service on the shared storage and, holding the lock, builds the CPU image
  there unless it is already built (and exports the OCI bundle when a collected test needs it); it keeps the service
  for its tests, then stops it and removes the storage (the bundle is all the other module needs).
- test_oci_jobs.py's `cpu_bundle` only needs the OCI bundle: if it is there, no engine at all; else, holding the
  lock, it starts the service on the shared storage, builds, exports, and stops the service, leaving the storage for
  test_image_build.py when that module is collected too.

The lock means no two services ever run on the same storage. The build is still done from this checkout each run (the
folder is new per run); a build that failed is recorded, and the other module fails with its message instead of
building again. Waiting for the lock is bounded (LOCK_WAIT_S) and fails naming the folder and the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpkit import image
from hpkit.commands import image as image_command

REPO = Path(__file__).resolve().parents[2]
BASE_TAG = "hpkit-base:bookworm"
CPU_TAG = "hpkit:cpu"
CACHE = Path(os.environ.get("HPKIT_IMAGE_CACHE") or Path.home() / ".cache" / "hpkit")
# The longest the other module may take to build and export (~6 min measured on 2 loaded cores), with room to spare.
LOCK_WAIT_S = 1800


@dataclass(frozen=True)
class Engine:
    host: str
    state: Path
    env: dict[str, str]  # for the podman CLI: the same config and storage as the service
    client: object


@dataclass(frozen=True)
class Shared:
    """The run's one copy of the image: files in `folder`, which every xdist worker of the run sees."""

    folder: Path

    @property
    def state(self) -> Path:
        # The podman service's socket, config and storage. AF_UNIX paths are limited to 108 bytes: a deep temporary
        # directory gets a folder under /tmp named after it, which every worker still computes alike.
        state = self.folder / "podman"
        if len(str(state / "podman.sock")) > 100:
            state = Path("/tmp") / (
                "hpkit-podman-" + hashlib.sha256(str(self.folder).encode()).hexdigest()[:12]
            )
        return state

    @property
    def bundle(self) -> Path:
        return self.folder / "oci" / "hpkit-cpu"

    @property
    def built(self) -> Path:  # the CPU image's id, written once built
        return self.folder / "built.json"

    @property
    def bundled(self) -> Path:  # written once the bundle is complete
        return self.folder / "bundled.json"

    @property
    def failed(self) -> Path:  # why the build or export failed
        return self.folder / "failed.txt"

    @contextlib.contextmanager
    def locked(self, who: str) -> Iterator[None]:
        # flock (not a lock file's existence): the kernel drops it if the holder dies, so no stale lock can stay.
        holder = self.folder / "holder.txt"
        fd = os.open(self.folder / "image.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            started = time.monotonic()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - started > LOCK_WAIT_S:
                        held = holder.read_text().strip() if holder.is_file() else "unknown"
                        pytest.fail(
                            f"waited {LOCK_WAIT_S} s for the CPU image that another test module is making "
                            f"({held}); its lock is {self.folder / 'image.lock'}: see that module's output"
                        )
                    time.sleep(1)
            waited = time.monotonic() - started
            if waited > 1:
                print(f"{who}: waited {waited:.0f} s for the shared CPU image")
            holder.write_text(f"{who}, pid {os.getpid()}, since {time.strftime('%H:%M:%S')}\n")
            yield
        finally:
            os.close(fd)  # releases the lock

    def check_not_failed(self) -> None:
        if self.failed.is_file():
            pytest.fail(
                f"the CPU image could not be made earlier in this run: {self.failed.read_text().strip()}"
            )


@pytest.fixture(scope="module")
def shared_folder(request, tmp_path_factory) -> Shared:
    """The folder of this run that every xdist worker shares: the parent of a worker's basetemp, else the basetemp."""
    base = tmp_path_factory.getbasetemp()
    run = base.parent if hasattr(request.config, "workerinput") else base
    folder = run / "hpkit-image"
    folder.mkdir(exist_ok=True)
    return Shared(folder)


def _wanted(request, fixture: str) -> bool:
    """Whether a test collected in this run (on any worker: each collects them all) asks for `fixture`."""
    return any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items)


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


@contextlib.contextmanager
def podman_service(state: Path) -> Iterator[Engine]:
    """podman's Docker API service with its config and storage in `state` (kept when it stops), as DOCKER_HOST."""
    state.mkdir(parents=True, exist_ok=True)
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


def _import_base(engine: Engine) -> None:
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


def _make(engine: Engine, shared: Shared, bundle: bool) -> None:
    """Holding the lock: the base and CPU images in the shared storage, and the OCI bundle if `bundle`; each once."""
    shared.check_not_failed()
    try:
        if shared.built.is_file():
            built = json.loads(shared.built.read_text())["id"]
            assert engine.client.images.get(CPU_TAG).id == built, "the shared storage lost the CPU image"
        else:
            _import_base(engine)
            started = time.monotonic()
            code = image_command.main(
                ["image", "build", "--cpu", "--quiet", "--base-image", BASE_TAG, "--context", str(REPO)]
            )
            assert code == 0, "`hpkit image build --cpu` failed: its output is above"
            built = engine.client.images.get(CPU_TAG).id
            shared.built.write_text(json.dumps({"id": built, "seconds": round(time.monotonic() - started)}))
            print(f"CPU image built in {time.monotonic() - started:.0f} s")
        if bundle and not shared.bundled.is_file():
            started = time.monotonic()
            assert image_command.main(["image", "export", "--oci", str(shared.bundle), CPU_TAG]) == 0
            shared.bundled.write_text(json.dumps({"id": built, "seconds": round(time.monotonic() - started)}))
            print(f"OCI bundle exported in {time.monotonic() - started:.0f} s")
    except BaseException as exc:  # pytest.fail and skip are BaseExceptions too
        shared.failed.write_text(f"{type(exc).__name__}: {exc}\n")
        raise


@pytest.fixture(scope="module")
def engine(request, shared_folder: Shared) -> Iterator[Engine]:
    """The service on the run's shared storage, holding the base image and the CPU image (made here unless the other
    module made them first). This module is the storage's last user: it removes it when done."""
    reason = unusable_reason()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        with shared_folder.locked("test_image_build's engine"):
            # Runs last, once the service has stopped: no module needs the storage after this one. Registered only
            # once the lock is held: a module still building there holds it.
            stack.callback(shutil.rmtree, shared_folder.state, ignore_errors=True)
            shared_folder.check_not_failed()
            made = stack.enter_context(podman_service(shared_folder.state))
            _make(made, shared_folder, bundle=_wanted(request, "cpu_bundle"))
        yield made


@pytest.fixture(scope="module")
def base_image(engine: Engine) -> str:
    return BASE_TAG


@pytest.fixture(scope="module")
def cpu_image(engine: Engine) -> str:
    return CPU_TAG


@pytest.fixture(scope="module")
def cpu_bundle(request, shared_folder: Shared) -> Path:
    """The CPU image as an OCI bundle (`hpkit image export --oci`), made once per run. Without an engine when the
    other module already made it; else a service on the shared storage for the build and export only."""
    reason = unusable_reason()
    if reason:
        pytest.skip(reason)
    with shared_folder.locked("test_oci_jobs' bundle"):
        shared_folder.check_not_failed()
        if not shared_folder.bundled.is_file():
            try:
                with podman_service(shared_folder.state) as made:
                    _make(made, shared_folder, bundle=True)
            finally:
                if not _wanted(request, "engine"):  # no module will use the storage again
                    shutil.rmtree(shared_folder.state, ignore_errors=True)
    return shared_folder.bundle
