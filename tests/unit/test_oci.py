"""container.runtime: oci: the spec's checks, the job's bundle, the rendering and `hpkit image export --oci`."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import ClassVar

import pytest

from hpkit import image, oci
from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.slurm.script import runtime_notes
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

ENV = ["PATH=/opt/venv/bin:/usr/bin:/bin", "VIRTUAL_ENV=/opt/venv"]


def _bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "image"
    root = bundle / "rootfs"
    for folder in ("usr/bin", "etc", "opt/venv", "proc", "tmp", "var/log"):
        (root / folder).mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "etc/hosts").write_text("")
    oci.write_json(bundle / "config.json", oci.runtime_config(ENV, ["bash"], "/work"))
    return bundle


def _spec(**container) -> JobSpec:
    data = {"name": "j", "nodes": 2, "tasks_per_node": 2, "container": {"runtime": "oci", **container}}
    return parse_document(JobSpec, data, "job.yaml")


def test_a_bundle_is_a_folder_with_rootfs_and_config(tmp_path: Path) -> None:
    assert oci.bundle_problem(_bundle(tmp_path)) is None
    assert "does not exist" in oci.bundle_problem(tmp_path / "nothing")
    (tmp_path / "file").write_text("")
    assert "not a directory" in oci.bundle_problem(tmp_path / "file")
    assert "no config.json" in oci.bundle_problem(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert "not an OCI runtime config" in oci.bundle_problem(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "process": {}}))
    assert "root file system" in oci.bundle_problem(tmp_path)


def test_submit_checks_name_the_field_in_one_line(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path)
    with pytest.raises(SpecError, match=r"^container\.image: .*does not exist") as err:
        oci.check_container(_spec(image=str(tmp_path / "missing")).job.container)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match=r"^container\.mounts: '/no/such:/data'"):
        oci.check_container(_spec(image=str(bundle), mounts=["/no/such:/data"]).job.container)
    oci.check_container(_spec(image=str(bundle), mounts=[f"{tmp_path}:/data"]).job.container)
    # pyxis images live in a registry or on the nodes: nothing to check on the submitting host.
    pyxis = parse_document(JobSpec, {"name": "j", "container": {"image": "/no/such.sqsh"}}, "job.yaml")
    oci.check_container(pyxis.job.container)


def test_oci_needs_an_absolute_bundle_path_and_no_mpi() -> None:
    # launcher: srun depends on the cluster's Slurm (tests/unit/test_slurm_24_11.py); mpi is refused everywhere.
    with pytest.raises(SpecError, match=r"launcher: mpi cannot run in container.runtime oci") as err:
        parse_document(
            JobSpec,
            {"name": "j", "launcher": "mpi", "container": {"runtime": "oci", "image": "/b"}},
            "job.yaml",
        )
    assert "\n" not in str(err.value).strip()
    with pytest.raises(SpecError, match=r"container.image: 'hpkit:cpu'.*hpkit image export --oci"):
        _spec(image="hpkit:cpu")
    assert _spec(image="/b").job.container.runtime == "oci"
    assert (
        parse_document(JobSpec, {"name": "j", "container": {"image": "x"}}, "j").job.container.runtime
        == "pyxis"
    )


def test_job_bundle_binds_the_image_read_only_and_adds_the_spec(tmp_path: Path) -> None:
    image_dir = _bundle(tmp_path)
    out = tmp_path / "job"
    config = oci.write_job_bundle(
        out, image_dir, ["/data:/data:ro"], var_log=True, workdir="/data", processes=3
    )
    assert config["root"] == {"path": "rootfs", "readonly": True}
    # runc's cgroup weighs as one process: the container gets its 3 busy processes' weight.
    assert config["linux"]["resources"]["cpu"] == {"shares": 3 * 1024}
    assert (out / "rootfs/bin").is_symlink() and (out / "rootfs/usr").is_dir()
    assert not any((out / "rootfs/usr").iterdir()), "the job's root holds mount points only"
    mounts = {m["destination"]: m for m in config["mounts"]}
    assert mounts["/usr"]["source"] == str((image_dir / "rootfs/usr").resolve())
    assert "ro" in mounts["/usr"]["options"] and "/bin" not in mounts
    assert mounts["/proc"]["type"] == "proc" and mounts["/tmp"]["type"] == "tmpfs"
    assert mounts["/var/log"]["source"] == "/var/log" and "rw" in mounts["/var/log"]["options"]
    assert mounts["/data"]["options"] == ["rbind", "ro"]
    if Path("/etc/hosts").is_file():
        assert mounts["/etc/hosts"]["source"] == "/etc/hosts"
    order = [m["destination"] for m in config["mounts"]]
    assert order.index("/var") < order.index("/var/log"), (
        "the image's /var first, the host's /var/log over it"
    )
    assert config["process"]["cwd"] == "/data"
    assert "HPKIT_IMAGE_PATH=/opt/venv/bin:/usr/bin:/bin" in config["process"]["env"]
    assert json.loads((out / "config.json").read_text()) == config
    # A requeued job writes it again over the first.
    again = oci.write_job_bundle(out, image_dir, [], var_log=False, workdir=None)
    assert "/var/log" not in {m["destination"] for m in again["mounts"]}
    assert again["process"]["cwd"] == "/work"


def test_bundle_command_refuses_a_missing_mount_source(tmp_path: Path, capsys) -> None:
    image_dir = _bundle(tmp_path)
    assert (
        oci.main(["bundle", "--image", str(image_dir), "--out", str(tmp_path / "j"), "--mount", "/no:/x"])
        == 1
    )
    assert "container.mounts: '/no:/x'" in capsys.readouterr().err
    assert oci.main(["bundle", "--image", str(image_dir), "--out", str(tmp_path / "j"), "--var-log"]) == 0


def test_render_writes_the_bundle_then_runs_srun_in_it() -> None:
    script = render(_spec(image="/images/cpu", mounts=["/fsx:/fsx"], startup_check="fail"))
    assert "python3 -m hpkit.oci bundle --image /images/cpu --var-log --mount /fsx:/fsx" in script
    assert 'srun_args+=(--container="$oci_bundle")' in script
    assert "--container-image" not in script
    assert 'export PATH="${HPKIT_IMAGE_PATH:-$PATH}"' in script
    assert "--nproc-per-node=2" in script and "--processes 3 --out" in script


def test_runtime_notes_say_what_oci_cannot_do() -> None:
    assert runtime_notes(_spec(image="/b").job) == []
    notes = runtime_notes(
        _spec(image="/b").job.model_copy(update={"gpus_per_node": 8, "tasks_per_node": None})
    )
    assert len(notes) == 1 and "NVIDIA" in notes[0]
    pyxis = parse_document(JobSpec, {"name": "j", "gpus_per_node": 8, "container": {"image": "x"}}, "j")
    assert runtime_notes(pyxis.job) == []
    # Warm starts in OCI: a script rendered by hand is not checked against the cluster's version at submit.
    (warm,) = runtime_notes(_spec(image="/b").job, warm=True)
    assert "warm starts need Slurm 24.11 or later" in warm and "hpkit submit checks" in warm


class _FakeImage:
    id = "sha256:" + "ab" * 32
    attrs: ClassVar[dict] = {
        "Config": {"Env": ENV, "Entrypoint": ["/usr/local/bin/hpkit-entrypoint"], "Cmd": ["bash"]}
    }


class _FakeContainer:
    removed = False

    def export(self):
        # A GB-sized image's export can wait longer than connect()'s 10 s ping timeout before its first bytes.
        assert _FakeClient.api.timeout == image.BUILD_READ_TIMEOUT_S
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as tar:
            for name in ("usr/", "usr/bin/", "etc/"):
                info = tarfile.TarInfo(name.rstrip("/"))
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            body = b"PRETTY_NAME=test\n"
            info = tarfile.TarInfo("etc/os-release")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        raw = data.getvalue()
        return (raw[i : i + 1000] for i in range(0, len(raw), 1000))

    def remove(self, force: bool = False) -> None:
        _FakeContainer.removed = True


class _FakeClient:
    class api:
        timeout = 10  # connect()'s

    class images:
        @staticmethod
        def get(ref):
            return _FakeImage()

    class containers:
        @staticmethod
        def create(image_id, command):
            return _FakeContainer()


def test_export_writes_rootfs_and_the_images_process(tmp_path: Path) -> None:
    pytest.importorskip("docker")
    bundle = tmp_path / "b"
    result = image.export_oci(_FakeClient(), "hpkit:cpu", bundle)
    assert result.bundle == bundle and _FakeContainer.removed
    assert _FakeClient.api.timeout == 10  # restored
    assert (bundle / "rootfs/etc/os-release").read_text() == "PRETTY_NAME=test\n"
    config = json.loads((bundle / "config.json").read_text())
    assert config["process"]["args"] == ["/usr/local/bin/hpkit-entrypoint", "bash"]
    assert config["process"]["env"] == ENV and config["root"]["path"] == "rootfs"
    assert oci.bundle_problem(bundle) is None
    # Again over the first: replaced whole; a folder holding something else is refused.
    image.export_oci(_FakeClient(), "hpkit:cpu", bundle)
    assert not list(bundle.glob(".rootfs*"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("mine")
    with pytest.raises(image.ImageError, match="not an OCI bundle"):
        image.export_oci(_FakeClient(), "hpkit:cpu", tmp_path / "other")
