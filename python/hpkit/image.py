"""Build, tag and import the training images through the Docker Engine API (docker SDK).

The SDK speaks the Engine API, so the same code drives Docker and podman's Docker-compatible service; DOCKER_HOST
picks the engine. Versions come from docker/versions.env only: each key the Dockerfile declares as an ARG is
passed as a build arg, and the tags name them. A failed build is reported as one line naming the failing step,
and the engine is told to remove intermediate containers even on failure (forcerm), so none are left behind.
"""

from __future__ import annotations

import configparser
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpkit import __version__, oci
from hpkit.errors import HpkitError

VERSIONS_FILE = "docker/versions.env"
WHEELHOUSE = "docker/wheelhouse"
DEFAULT_REPO = "hpkit"
BASE_TAG = "hpkit-base:bookworm"
PODMAN_SOCKET = "/run/hpkit-podman/podman.sock"
# Builds stream output, but a single step (pip installing torch) can be silent for minutes.
BUILD_READ_TIMEOUT_S = 3600
PING_TIMEOUT_S = 10

# The CPU image installs torch into Debian's own python3, so the wheel's tag follows the Debian release.
_DEBIAN_PYTHON_TAG = {"bookworm": "cp311", "trixie": "cp313"}
# Docker's classic builder: "Step 3/9 : RUN …"; podman (buildah): "[2/3] STEP 3/9: RUN …" (stage, then step).
_STEP = re.compile(r"^(?:\[(\d+)/(\d+)\] )?(?:Step|STEP) (\d+)/(\d+) ?: ?(.*)$")
_ARG = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE | re.MULTILINE)


class ImageError(HpkitError):
    """A build or import that did not produce an image."""


class EngineUnavailable(HpkitError):
    """No container engine answers on DOCKER_HOST."""


@dataclass(frozen=True)
class Variant:
    name: str
    dockerfile: str  # relative to the build context
    alias: str  # the moving tag besides the versioned one

    def version_tag(self, versions: dict[str, str], hpkit_version: str = __version__) -> str:
        torch = versions.get("TORCH_VERSION", "unknown")
        if self.name == "cpu":
            return f"{hpkit_version}-torch{torch}-cpu"
        cuda = versions.get("CUDA_VERSION", "unknown")
        nccl = versions.get("NCCL_VERSION", "unknown").split("-")[0]
        return f"{hpkit_version}-torch{torch}-cuda{cuda}-nccl{nccl}"


VARIANTS = {
    "gpu": Variant("gpu", "docker/Dockerfile", "latest"),
    "cpu": Variant("cpu", "docker/Dockerfile.cpu", "cpu"),
}


@dataclass(frozen=True)
class BuildRequest:
    context: Path
    dockerfile: str  # relative to context
    tags: list[str]  # repo:tag; the first is given to the build, the rest are added after
    buildargs: dict[str, str] = field(default_factory=dict)
    network_mode: str | None = None
    nocache: bool = False


@dataclass(frozen=True)
class BuildResult:
    image_id: str
    tags: list[str]
    seconds: float
    context_bytes: int


def read_versions(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; '#' comments and blank lines are skipped. No quoting, no expansion: one literal value."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ImageError(f"cannot read the versions file {path}: {exc.strerror or exc}") from None
    versions: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if (
            not sep
            or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key)
            or not value
            or any(c in value for c in " \"'$`")
        ):
            raise ImageError(
                f"{path}:{number}: expected KEY=VALUE (upper-case key, plain value), got {raw!r}"
            )
        if key in versions:
            raise ImageError(f"{path}:{number}: {key} is set twice")
        versions[key] = value
    return versions


def declared_args(dockerfile_text: str) -> set[str]:
    return set(_ARG.findall(dockerfile_text))


def build_args(
    dockerfile_text: str, versions: dict[str, str], extra: dict[str, str] | None = None
) -> dict[str, str]:
    """The versions this Dockerfile declares, hpkit's own version, then the caller's overrides."""
    declared = declared_args(dockerfile_text)
    args = {k: v for k, v in versions.items() if k in declared}
    if "HPKIT_VERSION" in declared:
        args["HPKIT_VERSION"] = __version__
    for key, value in (extra or {}).items():
        if key not in declared:
            raise ImageError(
                f"--build-arg {key}: the Dockerfile declares no ARG {key} (it has: {', '.join(sorted(declared))})"
            )
        args[key] = value
    return args


def image_tags(variant: Variant, versions: dict[str, str], repo: str = DEFAULT_REPO) -> list[str]:
    return [f"{repo}:{variant.version_tag(versions)}", f"{repo}:{variant.alias}"]


# --- the build log ----------------------------------------------------------------------------------------


class BuildLog:
    """Turns the Engine API's build stream (Docker's classic builder or podman's) into lines and a failure line."""

    def __init__(self) -> None:
        self.step: tuple[str, str] | None = None  # (where, instruction)
        self.image_id: str | None = None
        self.error: str | None = None
        self._last_output: str | None = None
        self._partial = ""

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """Lines to show for one decoded chunk; records steps, the image id and the error."""
        if "error" in chunk or "errorDetail" in chunk:
            detail = chunk.get("errorDetail") or {}
            self.error = str(detail.get("message") or chunk.get("error") or "unknown error").strip()
            return []
        aux = chunk.get("aux")
        if isinstance(aux, dict) and aux.get("ID"):
            self.image_id = str(aux["ID"])
        text = chunk.get("stream")
        if not isinstance(text, str):
            return []
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        shown = []
        for line in lines:
            line = line.rstrip("\r")
            match = _STEP.match(line)
            if match:
                stage = f"stage {match.group(1)}/{match.group(2)} " if match.group(1) else ""
                self.step = (f"{stage}step {match.group(3)}/{match.group(4)}", match.group(5).strip())
            elif line.strip():
                self._last_output = line.strip()
                built = re.match(r"^Successfully built ([0-9a-f]{12,64})$", line.strip())
                if built and not self.image_id:
                    self.image_id = built.group(1)
            shown.append(line)
        return shown

    def failure(self) -> str:
        """One line: the failing step, the engine's message, and the step's last output line."""
        message = _one_line(self.error or "the engine ended the build without an image")
        where = "the build failed"
        # buildah runs stages side by side, so the last step shown need not be the failing one; its message
        # names the failing instruction itself ('building at STEP "RUN …"').
        if self.step and "building at STEP" not in message:
            place, instruction = self.step
            if len(instruction) > 100:
                instruction = instruction[:97] + "..."
            where = f"the build failed at {place} ({instruction})"
        last = self._last_output
        if last and last not in message and not _STEP.match(last):
            message += f"; last output: {_one_line(last)}"
        return f"{where}: {message}"


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the engine -----------------------------------------------------------------------------------------


def engine_hint() -> str:
    return (
        "start Docker (`systemctl start docker`), or podman's Docker API: "
        f"`scripts/podman-service.sh start` then `export DOCKER_HOST=unix://{PODMAN_SOCKET}`"
    )


def connect(timeout: int = PING_TIMEOUT_S) -> Any:
    """A docker.DockerClient that has answered a ping; EngineUnavailable (one line, with the fix) otherwise."""
    try:
        import docker
        import docker.errors
    except ImportError:
        raise EngineUnavailable(
            "the docker SDK is not installed: pip install 'hpkit[image]' (docker>=7)"
        ) from None
    host = os.environ.get("DOCKER_HOST")
    where = f"DOCKER_HOST={host}" if host else "unix:///var/run/docker.sock (DOCKER_HOST is unset)"
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    # The SDK raises DockerException, requests' errors or OSError here; whichever, nothing answers on that
    # socket, and how to start an engine is what helps.
    except Exception:
        raise EngineUnavailable(f"no container engine answers at {where}: {engine_hint()}") from None
    return client


def _context_tar(context: Path, dockerfile: str) -> tuple[Any, int]:
    """The build context as a tar file, honouring .dockerignore the way the docker CLI does."""
    from docker.utils.build import tar

    ignore = context / ".dockerignore"
    patterns: list[str] = []
    if ignore.is_file():
        patterns = [
            line.strip()
            for line in ignore.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
    fileobj = tar(str(context), exclude=patterns, dockerfile=(dockerfile, None))
    size = fileobj.seek(0, os.SEEK_END)
    fileobj.seek(0)
    return fileobj, size


def build(client: Any, request: BuildRequest, show: Callable[[str], None] = print) -> BuildResult:
    """Build through the Engine API, streaming the log to show(); ImageError carries the one-line failure."""
    import docker.errors

    started = time.monotonic()
    fileobj, size = _context_tar(request.context, request.dockerfile)
    show(f"sending a {size / 1e6:.1f} MB build context; building {request.dockerfile} as {request.tags[0]}")
    log = BuildLog()
    try:
        stream: Iterator[dict[str, Any]] = client.api.build(
            fileobj=fileobj,
            custom_context=True,
            dockerfile=request.dockerfile,
            tag=request.tags[0],
            buildargs=request.buildargs,
            network_mode=request.network_mode,
            nocache=request.nocache,
            rm=True,
            forcerm=True,
            decode=True,
            timeout=BUILD_READ_TIMEOUT_S,
        )
        step = None
        for chunk in stream:
            for line in log.feed(chunk):
                if log.step != step:
                    step = log.step
                    elapsed = time.monotonic() - started
                    show(f"[{int(elapsed) // 60}:{int(elapsed) % 60:02d}] {line}")
                else:
                    show(line)
    except docker.errors.APIError as exc:
        raise ImageError(f"the engine refused the build: {_one_line(str(exc.explanation or exc))}") from None
    except Exception as exc:  # a dropped connection or read timeout mid-build
        raise ImageError(f"lost the engine during the build: {_one_line(str(exc))}") from None
    finally:
        fileobj.close()
    if log.error or not log.image_id:
        raise ImageError(log.failure())
    for ref in request.tags[1:]:
        repo, _, tag = ref.rpartition(":")
        client.api.tag(log.image_id, repo, tag)
    return BuildResult(log.image_id, list(request.tags), time.monotonic() - started, size)


def import_base(client: Any, tarball: Path, ref: str = BASE_TAG) -> str:
    """Import a root file system tarball (mmdebstrap's) as an image; returns its id."""
    import docker.errors

    if not tarball.is_file():
        raise ImageError(f"{tarball}: no such file (make it with `make image-base`)")
    repo, _, tag = ref.rpartition(":")
    reply = ""
    try:
        # The whole reference as `repo`: podman's compat import ignores a separate `tag`, Docker accepts both.
        reply = str(client.api.import_image_from_file(str(tarball), repository=ref))
        imported = re.search(r"sha256:[0-9a-f]{64}", reply)
        if imported:
            client.api.tag(imported.group(0), repo, tag)
        return str(client.images.get(ref).id)
    except docker.errors.ImageNotFound:
        raise ImageError(f"importing {tarball} gave no image {ref}: {_one_line(reply)}") from None
    except docker.errors.APIError as exc:
        raise ImageError(
            f"the engine refused to import {tarball}: {_one_line(str(exc.explanation or exc))}"
        ) from None


# --- OCI bundles (Slurm's own containers) ---------------------------------------------------------------


@dataclass(frozen=True)
class ExportResult:
    image_id: str
    bundle: Path
    seconds: float


@contextmanager
def _api_timeout(client: Any, seconds: float) -> Iterator[None]:
    """The client's read timeout set to `seconds` for the calls inside, then put back."""
    saved = client.api.timeout
    client.api.timeout = seconds
    try:
        yield
    finally:
        client.api.timeout = saved


def export_oci(client: Any, ref: str, bundle: Path) -> ExportResult:
    """Write image `ref` as an OCI bundle: bundle/rootfs (its file system) and bundle/config.json (runc's).

    The file system is the engine's export of a container created (never started) from the image; the config
    carries the image's environment, command and working directory (hpkit.oci.runtime_config). A bundle
    already there is replaced only once the new one is complete.
    """
    import docker.errors

    started = time.monotonic()
    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound:
        raise ImageError(f"no image {ref} in the engine: build it first (make image-cpu)") from None
    if bundle.exists() and not bundle.is_dir():
        raise ImageError(f"{bundle} is a file: give a directory for the bundle")
    if bundle.is_dir() and any(bundle.iterdir()) and not (bundle / oci.CONFIG).is_file():
        raise ImageError(
            f"{bundle} holds other files and is not an OCI bundle: give an empty or new directory"
        )
    bundle.mkdir(parents=True, exist_ok=True)
    partial = bundle / f".{oci.ROOTFS}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    # The client's timeout is connect()'s ping timeout (10 s); creating a container from a GB-sized image and the first
    # bytes of its export can take longer on a loaded host (measured: ReadTimeout on 2 busy cores), as a build can.
    with _api_timeout(client, BUILD_READ_TIMEOUT_S):
        container = client.containers.create(image.id, command=["true"])
        try:
            untar = subprocess.Popen(
                ["tar", "-x", "--numeric-owner", "-p", "-f", "-", "-C", str(partial)], stdin=subprocess.PIPE
            )
            assert untar.stdin is not None
            try:
                for chunk in container.export():
                    untar.stdin.write(chunk)
            finally:
                untar.stdin.close()
                status = untar.wait()
            if status != 0:
                raise ImageError(f"unpacking {ref}'s file system into {partial} failed (tar exit {status})")
        except docker.errors.APIError as exc:
            raise ImageError(
                f"the engine could not export {ref}: {_one_line(str(exc.explanation or exc))}"
            ) from None
        finally:
            container.remove(force=True)
    config = image.attrs.get("Config") or {}
    runtime = oci.runtime_config(
        env=list(config.get("Env") or []),
        args=[*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])],
        cwd=config.get("WorkingDir") or "/",
    )
    old = bundle / f".{oci.ROOTFS}.old"
    if (bundle / oci.ROOTFS).exists():
        shutil.rmtree(old, ignore_errors=True)
        (bundle / oci.ROOTFS).rename(old)
    partial.rename(bundle / oci.ROOTFS)
    oci.write_json(bundle / oci.CONFIG, runtime)
    shutil.rmtree(old, ignore_errors=True)
    return ExportResult(str(image.id), bundle, time.monotonic() - started)


# --- the CPU wheelhouse -----------------------------------------------------------------------------------


def _find_links() -> list[Path]:
    """Folders pip itself would search: PIP_FIND_LINKS and find-links in pip's config files."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    parser = configparser.ConfigParser()
    configs = ["/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        configs.append(os.environ["PIP_CONFIG_FILE"])
    parser.read([os.path.expanduser(p) for p in configs])
    for section in ("global", "install"):
        values += parser.get(section, "find-links", fallback="").split()
    folders = []
    for value in values:
        path = Path(value.removeprefix("file://"))
        if path.is_dir() and path not in folders:
            folders.append(path)
    return folders


def stage_torch_wheel(
    context: Path, torch_version: str, debian_release: str, search: Iterable[Path] | None = None
) -> Path | None:
    """Put the CPU torch wheel the image needs into the context's wheelhouse (hard link, else copy).

    Returns the wheel, or None when none is found; other wheels there are removed so the context stays small.
    """
    py_tag = _DEBIAN_PYTHON_TAG.get(debian_release)
    if py_tag is None:
        raise ImageError(
            f"DEBIAN_RELEASE={debian_release}: hpkit knows the Python of {', '.join(_DEBIAN_PYTHON_TAG)} only"
        )
    name = re.compile(
        rf"^torch-{re.escape(torch_version)}\+cpu-{py_tag}-{py_tag}-manylinux[^-]*_{re.escape(platform.machine())}\.whl$"
    )
    wheelhouse = context / WHEELHOUSE
    wheelhouse.mkdir(parents=True, exist_ok=True)
    found = None
    for existing in wheelhouse.glob("*.whl"):
        if name.match(existing.name):
            found = existing
        else:
            existing.unlink()
    if found:
        return found
    for folder in search if search is not None else _find_links():
        for candidate in sorted(folder.glob("torch-*.whl")):
            if name.match(candidate.name):
                target = wheelhouse / candidate.name
                try:
                    os.link(candidate, target)
                except OSError:
                    shutil.copy2(candidate, target)
                return target
    return None


# --- a build from the checkout ---------------------------------------------------------------------------


def checkout_versions(context: Path) -> dict[str, str]:
    """The versions file of the hpkit checkout at `context`."""
    path = context / VERSIONS_FILE
    if not path.is_file():
        raise ImageError(f"{path}: not found: run from the hpkit checkout or pass --context")
    return read_versions(path)


def prepare_build(
    context: Path,
    variant: Variant,
    repo: str = DEFAULT_REPO,
    extra_args: dict[str, str] | None = None,
    network_mode: str | None = None,
    nocache: bool = False,
) -> BuildRequest:
    """The request that builds `variant` from the checkout; for the CPU image, its torch wheel is staged first."""
    versions = checkout_versions(context)
    dockerfile = context / variant.dockerfile
    buildargs = build_args(dockerfile.read_text(encoding="utf-8"), versions, extra_args)
    if variant.name == "cpu" and not buildargs.get("TORCH_EXTRA_INDEX"):
        torch, release = buildargs["TORCH_VERSION"], buildargs["DEBIAN_RELEASE"]
        if stage_torch_wheel(context, torch, release) is None:
            raise ImageError(
                f"no torch-{torch}+cpu wheel for {release}'s Python on {platform.machine()} in {WHEELHOUSE} or pip's "
                "find-links: put it there, or pass --build-arg TORCH_EXTRA_INDEX=https://download.pytorch.org/whl/cpu"
            )
    return BuildRequest(
        context=context,
        dockerfile=variant.dockerfile,
        tags=image_tags(variant, versions, repo),
        buildargs=buildargs,
        network_mode=network_mode,
        nocache=nocache,
    )
