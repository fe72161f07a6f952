"""Each check against fabricated /proc, /sys, /opt, /etc trees and fake programs: it reads what is there."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from _imds_server import imds_server

from hpkit.checks import (
    container,
    libstdcxx,
    mounts,
    network_efa,
    python_env,
    slurm,
    storage,
    torch_cuda,
)
from hpkit.checks.context import Context, Roots
from hpkit.checks.result import Result, Status

ROOT_MOUNT = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
VAR_LOG_BIND = "612 600 259:1 /var/log /var/log rw,relatime - xfs /dev/nvme0n1p1 rw\n"


@pytest.fixture(autouse=True)
def _never_real_imds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def roots(tmp_path: Path) -> Roots:
    made = Roots(
        *(tmp_path / name for name in ("proc", "sys", "opt", "etc", "var/log", "usr")),
        proc_self=tmp_path / "proc" / "self",
    )
    for folder in (made.proc / "self", made.sys, made.opt, made.etc, made.var_log, made.usr):
        folder.mkdir(parents=True)
    (made.proc / "self" / "mountinfo").write_text(ROOT_MOUNT)
    return made


def ctx_for(roots: Roots, profile: str = "compute", **env: str) -> Context:
    base = {"PATH": str(roots.opt / "bin"), "AWS_EC2_METADATA_DISABLED": "true", "HOME": str(roots.opt)}
    return Context(profile=profile, roots=roots, env={**base, **env}, probe_timeout=2.0, python_path=[])


def write(path: Path, text: str = "", mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    if mode is not None:
        path.chmod(mode)
    return path


def program(roots: Roots, name: str, script: str) -> Path:
    """A fake command on the context's PATH."""
    return write(roots.opt / "bin" / name, "#!/bin/sh\n" + textwrap.dedent(script), 0o755)


def assert_fixable(result: Result) -> None:
    if result.status is not Status.PASS:
        assert result.fix.strip(), result


# --- container: /var/log and HyperPod ------------------------------------------------------------


def test_var_log_bind_mount_present(roots: Roots) -> None:
    (roots.proc / "self" / "mountinfo").write_text(ROOT_MOUNT + VAR_LOG_BIND)
    result = container.var_log_mount(ctx_for(roots, "container"))
    assert result.status is Status.PASS and "/dev/nvme0n1p1" in result.detail


def test_var_log_bind_mount_absent(roots: Roots) -> None:
    result = container.var_log_mount(ctx_for(roots, "container"))
    assert result.status is Status.FAIL and "-v /var/log:/var/log" in result.fix


def test_var_log_fresh_tmpfs_is_not_the_hosts(roots: Roots) -> None:
    tmpfs = "700 600 0:90 / /var/log rw,nosuid - tmpfs tmpfs rw\n"
    (roots.proc / "self" / "mountinfo").write_text(ROOT_MOUNT + tmpfs)
    assert container.var_log_mount(ctx_for(roots, "container")).status is Status.FAIL


def test_var_log_read_only_bind_warns(roots: Roots) -> None:
    (roots.proc / "self" / "mountinfo").write_text(
        ROOT_MOUNT + VAR_LOG_BIND.replace(" rw,relatime", " ro,relatime")
    )
    result = container.var_log_mount(ctx_for(roots, "container"))
    assert result.status is Status.WARN and result.fix


def test_hyperpod_marker_absent_skips(roots: Roots) -> None:
    result = container.hyperpod_logs(ctx_for(roots))
    assert result.status is Status.SKIP and "resource_config.json" in result.detail
    assert "sagemaker_cluster" in result.detail


def test_hyperpod_sagemaker_cluster_marker_counts(roots: Roots) -> None:
    (roots.opt / "sagemaker_cluster").mkdir(parents=True)
    result = container.hyperpod_logs(ctx_for(roots))
    assert result.status is Status.FAIL and "HyperPod node" in result.detail


def test_hyperpod_marker_present_logs_present(roots: Roots) -> None:
    write(roots.opt / "ml" / "config" / "resource_config.json", "{}")
    (roots.var_log / "aws" / "clusters").mkdir(parents=True)
    assert container.hyperpod_logs(ctx_for(roots)).status is Status.PASS


def test_hyperpod_marker_present_logs_missing(roots: Roots) -> None:
    write(roots.opt / "ml" / "config" / "resource_config.json", "{}")
    result = container.hyperpod_logs(ctx_for(roots, "container"))
    assert result.status is Status.FAIL and "/var/log/aws/clusters" in result.detail


def test_mountinfo_unescapes_and_finds_the_longest_mount() -> None:
    text = ROOT_MOUNT + "40 27 0:50 / /mnt/with\\040space rw - nfs4 fs:/export rw\n"
    parsed = mounts.parse_mountinfo(text)
    assert parsed[1].mount_point == "/mnt/with space" and parsed[1].fstype == "nfs4"
    assert mounts.mount_of("/mnt/with space/ckpt", parsed) == parsed[1]
    assert mounts.mount_of("/mnt/other", parsed) == parsed[0]


# --- EFA, NCCL, aws-ofi-nccl ----------------------------------------------------------------------


def make_efa(roots: Roots, count: int) -> None:
    driver = roots.sys / "bus" / "pci" / "drivers" / "efa"
    driver.mkdir(parents=True)
    for index in range(count):
        device = roots.sys / "devices" / f"0000:{index:02x}:00.0"
        device.mkdir(parents=True)
        (device / "driver").symlink_to(driver)
        entry = roots.sys / "class" / "infiniband" / f"rdmap{index}s27"
        entry.mkdir(parents=True)
        (entry / "device").symlink_to(device)


def fi_info(roots: Roots, works: bool = True) -> None:
    body = (
        'echo "provider: efa"\necho "    fabric: efa"\n'
        if works
        else 'echo "fi_getinfo: -61 (No data)" >&2\nexit 61\n'
    )
    write(roots.opt / "amazon" / "efa" / "bin" / "fi_info", "#!/bin/sh\n" + body, 0o755)


def test_efa_devices_absent(roots: Roots) -> None:
    result = network_efa.efa(ctx_for(roots))
    assert result.status is Status.FAIL and "/sys/class/infiniband" in result.detail and result.fix


def test_efa_devices_present_with_provider(roots: Roots) -> None:
    make_efa(roots, 4)
    fi_info(roots)
    assert network_efa.efa_devices(ctx_for(roots)) == [f"rdmap{i}s27" for i in range(4)]
    result = network_efa.efa(ctx_for(roots))
    assert result.status is Status.PASS and "4 EFA device" in result.detail


def test_efa_devices_present_without_fi_info_warns(roots: Roots) -> None:
    make_efa(roots, 1)
    result = network_efa.efa(ctx_for(roots))
    assert result.status is Status.WARN and "fi_info" in result.detail


def test_efa_provider_missing_fails(roots: Roots) -> None:
    make_efa(roots, 1)
    fi_info(roots, works=False)
    result = network_efa.efa(ctx_for(roots))
    assert result.status is Status.FAIL and "No data" in result.detail


def test_efa_fewer_devices_than_the_instance_type_has(roots: Roots) -> None:
    make_efa(roots, 2)
    fi_info(roots)
    with imds_server(mode="v2", instance_type="ml.p4d.24xlarge") as (url, _):
        ctx = ctx_for(roots, AWS_EC2_METADATA_DISABLED="false", AWS_EC2_METADATA_SERVICE_ENDPOINT=url)
        result = network_efa.efa(ctx)
    assert result.status is Status.WARN and "has 4" in result.detail


def test_nccl_from_wheel_and_system(roots: Roots, tmp_path: Path) -> None:
    site = tmp_path / "site"
    write(
        site / "nvidia_nccl_cu12-2.21.5.dist-info" / "METADATA", "Name: nvidia-nccl-cu12\nVersion: 2.21.5\n"
    )
    write(roots.opt / "nccl" / "build" / "lib" / "libnccl.so.2.18.5")
    ctx = ctx_for(roots)
    ctx.python_path = [str(site)]
    result = network_efa.nccl(ctx)
    assert result.status is Status.PASS
    assert "2.21.5" in result.detail and "2.18.5" in result.detail


def test_nccl_absent(roots: Roots) -> None:
    result = network_efa.nccl(ctx_for(roots))
    assert result.status is Status.FAIL and result.fix


def test_ofi_plugin_on_loader_path(roots: Roots) -> None:
    lib = roots.opt / "amazon" / "ofi-nccl" / "lib"
    write(lib / "libnccl-net.so")
    assert network_efa.aws_ofi_nccl(ctx_for(roots, LD_LIBRARY_PATH=str(lib))).status is Status.PASS
    write(roots.etc / "ld.so.conf.d" / "ofi.conf", f"# aws-ofi-nccl\n{lib}\n")
    assert network_efa.aws_ofi_nccl(ctx_for(roots)).status is Status.PASS


def test_ofi_plugin_installed_but_not_on_loader_path(roots: Roots) -> None:
    write(roots.opt / "amazon" / "ofi-nccl" / "lib" / "libnccl-net-ofi.so")
    result = network_efa.aws_ofi_nccl(ctx_for(roots))
    assert result.status is Status.WARN and "LD_LIBRARY_PATH" in result.fix


def test_ofi_plugin_absent(roots: Roots) -> None:
    assert network_efa.aws_ofi_nccl(ctx_for(roots)).status is Status.FAIL


# --- PyTorch, CUDA, driver, GPUs ------------------------------------------------------------------


def fake_torch(tmp_path: Path, version: str, cuda: str | None) -> list[str]:
    site = tmp_path / "site"
    write(
        site / f"torch-{version}.dist-info" / "METADATA",
        f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
    )
    cuda_line = f"cuda: Optional[str] = {cuda!r}" if cuda else "cuda: Optional[str] = None"
    write(site / "torch" / "version.py", f"__version__ = {version!r}\n{cuda_line}\n")
    return [str(site)]


@pytest.mark.parametrize(
    ("version", "cuda", "torch_status", "cuda_status"),
    [
        ("2.3.1+cu121", "12.1", Status.PASS, Status.PASS),
        ("2.0.1", "11.8", Status.PASS, Status.PASS),
        ("2.0.0", "11.7", Status.FAIL, Status.FAIL),
        ("2.13.0+cpu", None, Status.PASS, Status.FAIL),
    ],
)
def test_torch_and_cuda_versions_without_importing_torch(
    roots: Roots, tmp_path: Path, version: str, cuda: str | None, torch_status: Status, cuda_status: Status
) -> None:
    ctx = ctx_for(roots)
    ctx.python_path = fake_torch(tmp_path, version, cuda)
    assert torch_cuda.torch_version(ctx).status is torch_status
    result = torch_cuda.cuda_runtime(ctx)
    assert result.status is cuda_status
    assert_fixable(result)


def test_torch_missing(roots: Roots) -> None:
    ctx = ctx_for(roots)
    assert torch_cuda.torch_version(ctx).status is Status.FAIL
    assert torch_cuda.cuda_runtime(ctx).status is Status.SKIP


def gpus(roots: Roots, count: int, model: str = "NVIDIA A100-SXM4-40GB") -> None:
    write(
        roots.proc / "driver" / "nvidia" / "version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n",
    )
    for index in range(count):
        write(
            roots.proc / "driver" / "nvidia" / "gpus" / f"0000:{16 + index:02x}:1c.0" / "information",
            f"Model: \t {model}\n",
        )


@pytest.mark.parametrize(
    ("driver_cuda", "torch_cuda_version", "status"),
    [((12, 2), "12.1", Status.PASS), ((12, 2), "12.4", Status.WARN), ((11, 8), "12.1", Status.FAIL)],
)
def test_driver_against_the_cuda_runtime(
    roots: Roots,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    driver_cuda: tuple[int, int],
    torch_cuda_version: str,
    status: Status,
) -> None:
    gpus(roots, 1)
    monkeypatch.setattr(torch_cuda, "driver_cuda_version", lambda: driver_cuda)
    ctx = ctx_for(roots)
    ctx.python_path = fake_torch(tmp_path, "2.3.1", torch_cuda_version)
    result = torch_cuda.nvidia_driver(ctx)
    assert result.status is status and "535.104.05" in result.detail
    assert_fixable(result)


def test_no_driver(roots: Roots) -> None:
    assert torch_cuda.nvidia_driver(ctx_for(roots)).status is Status.FAIL
    assert torch_cuda.gpu_count(ctx_for(roots)).status is Status.FAIL


def test_gpu_count_without_instance_type(roots: Roots) -> None:
    gpus(roots, 2)
    result = torch_cuda.gpu_count(ctx_for(roots))
    assert result.status is Status.PASS and "2 × NVIDIA A100-SXM4-40GB" in result.detail


@pytest.mark.parametrize(("count", "status"), [(8, Status.PASS), (7, Status.FAIL)])
def test_gpu_count_against_the_instance_type(roots: Roots, count: int, status: Status) -> None:
    gpus(roots, count)
    with imds_server(mode="v2", instance_type="ml.p4d.24xlarge") as (url, _):
        ctx = ctx_for(roots, AWS_EC2_METADATA_DISABLED="false", AWS_EC2_METADATA_SERVICE_ENDPOINT=url)
        result = torch_cuda.gpu_count(ctx)
    assert result.status is status
    assert_fixable(result)


# --- libstdc++ ------------------------------------------------------------------------------------


def fake_libstdcxx(roots: Roots, tmp_path: Path, newest: int) -> None:
    lib = tmp_path / "lib" / "libstdc++.so.6.0.99"
    symbols = b"".join(b"GLIBCXX_3.4.%d\x00" % n for n in range(20, newest + 1))
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF junk\x00" + symbols + b"CXXABI_1.3.9\x00")
    maps = f"7f00-7f10 r-xp 00000000 fe:00 123 {lib}\n7f10-7f20 r-xp 00000000 fe:00 124 /usr/lib/libc.so.6\n"
    write(roots.proc / "self" / "maps", maps)


@pytest.mark.parametrize(("newest", "status"), [(30, Status.PASS), (33, Status.PASS), (29, Status.FAIL)])
def test_libstdcxx_versions(roots: Roots, tmp_path: Path, newest: int, status: Status) -> None:
    fake_libstdcxx(roots, tmp_path, newest)
    result = libstdcxx.libstdcxx(ctx_for(roots))
    assert result.status is status and f"GLIBCXX_3.4.{newest}" in result.detail
    assert_fixable(result)


def test_libstdcxx_of_this_process() -> None:
    result = libstdcxx.libstdcxx(Context(profile="compute", env={}))
    # The verdict against one worked out here independently: the mapped library's own version strings.
    maps = Path("/proc/self/maps").read_text().splitlines()
    (path,) = {
        line.split()[-1] for line in maps if line.split()[-1].split("/")[-1].startswith("libstdc++.so")
    }
    newest = max(int(n) for n in re.findall(rb"GLIBCXX_3\.4\.(\d+)\b", Path(path).read_bytes()))
    assert path in result.detail and f"GLIBCXX_3.4.{newest}" in result.detail, result
    assert result.status is (Status.PASS if newest >= 30 else Status.FAIL), result


# --- Slurm, pyxis, enroot -------------------------------------------------------------------------


def test_slurm_answers(roots: Roots) -> None:
    program(roots, "sinfo", 'echo "dev*|2|idle"; echo "dev*|1|down*"; echo "gpu|4|mix"\n')
    result = slurm.slurm(ctx_for(roots, "login"))
    assert result.status is Status.PASS
    assert "2 partition(s)" in result.detail and "2 idle" in result.detail and "1 down" in result.detail


def test_slurm_all_nodes_down_warns(roots: Roots) -> None:
    program(roots, "sinfo", 'echo "dev*|2|drain"\n')
    assert slurm.slurm(ctx_for(roots, "login")).status is Status.WARN


def test_slurm_unreachable(roots: Roots) -> None:
    program(
        roots, "sinfo", 'echo "sinfo: error: x" >&2; echo "sinfo: fatal: Could not establish" >&2; exit 1\n'
    )
    result = slurm.slurm(ctx_for(roots, "login"))
    assert (
        result.status is Status.FAIL and "Could not establish" in result.detail and "SLURM_CONF" in result.fix
    )


def test_slurm_hung_controller_is_bounded(roots: Roots) -> None:
    program(roots, "sinfo", "exec /bin/sleep 30\n")
    ctx = ctx_for(roots, "login")
    ctx.probe_timeout = 0.3
    result = slurm.slurm(ctx)
    assert result.status is Status.FAIL and "did not finish within 0.3 s" in result.detail


def test_slurm_missing(roots: Roots) -> None:
    assert slurm.slurm(ctx_for(roots, "login")).status is Status.FAIL


def test_slurm_found_under_opt_slurm(roots: Roots) -> None:
    write(roots.opt / "slurm" / "bin" / "sinfo", '#!/bin/sh\necho "dev*|1|idle"\n', 0o755)
    assert slurm.slurm(ctx_for(roots, "login")).status is Status.PASS


def test_pyxis_listed_by_srun(roots: Roots) -> None:
    program(roots, "srun", 'echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"\n')
    assert slurm.pyxis(ctx_for(roots, "login")).status is Status.PASS


def test_pyxis_not_loaded(roots: Roots) -> None:
    program(roots, "srun", 'echo "Usage: srun [OPTIONS...] executable"\n')
    result = slurm.pyxis(ctx_for(roots, "login"))
    assert result.status is Status.FAIL and "spank_pyxis" in result.fix


def test_pyxis_from_plugstack_when_srun_cannot_run(roots: Roots) -> None:
    program(roots, "srun", 'echo "srun: fatal: Could not establish a configuration source" >&2; exit 1\n')
    write(
        roots.etc / "slurm" / "plugstack.conf",
        "include /nonexistent/*.conf\ninclude plugstack.conf.d/*.conf\n",
    )
    assert slurm.pyxis(ctx_for(roots, "login")).status is Status.FAIL
    write(roots.etc / "slurm" / "plugstack.conf.d" / "pyxis.conf", "required /usr/lib/slurm/spank_pyxis.so\n")
    result = slurm.pyxis(ctx_for(roots, "login"))
    assert result.status is Status.WARN and "pyxis.conf" in result.detail


def test_enroot_paths_on_a_large_disk(roots: Roots, monkeypatch: pytest.MonkeyPatch) -> None:
    program(roots, "enroot", 'echo "3.4.1"\n')
    write(
        roots.etc / "enroot" / "enroot.conf",
        "ENROOT_RUNTIME_PATH /nvme/tmp/enroot/user-$(id -u)\nENROOT_CACHE_PATH ${HOME}/cache  # comment\n",
    )
    paths = slurm._enroot_paths(ctx_for(roots, "login"))
    assert paths["ENROOT_RUNTIME_PATH"] == f"/nvme/tmp/enroot/user-{os.getuid()}"
    assert paths["ENROOT_CACHE_PATH"] == f"{roots.opt}/cache"
    monkeypatch.setattr(slurm, "_free_gib", lambda path: (path, 500.0))
    result = slurm.enroot(ctx_for(roots, "login"))
    assert result.status is Status.PASS and "3.4.1" in result.detail
    monkeypatch.setattr(slurm, "_free_gib", lambda path: (path, 8.0))
    result = slurm.enroot(ctx_for(roots, "login"))
    assert result.status is Status.WARN and "ENROOT_DATA_PATH" in result.fix


def test_enroot_missing(roots: Roots) -> None:
    assert slurm.enroot(ctx_for(roots, "login")).status is Status.FAIL


# --- storage, python ------------------------------------------------------------------------------


def test_shared_fs_found(roots: Roots) -> None:
    lustre = "90 27 0:60 / /fsx rw - lustre 10.1.2.3@tcp:/abcdefgh rw\n"
    (roots.proc / "self" / "mountinfo").write_text(ROOT_MOUNT + lustre)
    result = storage.shared_fs(ctx_for(roots, "login"))
    assert result.status is Status.PASS and "/fsx (lustre)" in result.detail


def test_shared_fs_absent(roots: Roots) -> None:
    assert storage.shared_fs(ctx_for(roots, "login")).status is Status.FAIL


def test_shared_fs_named_path(roots: Roots, tmp_path: Path) -> None:
    ctx = ctx_for(roots, "login")
    ctx.shared_fs = tmp_path
    assert storage.shared_fs(ctx).status is Status.FAIL  # on the root ext4: node-local
    nfs = f"91 27 0:61 / {tmp_path} rw - nfs4 fs-1.efs:/ rw\n"
    (roots.proc / "self" / "mountinfo").write_text(ROOT_MOUNT + nfs)
    assert storage.shared_fs(ctx).status is Status.PASS


@pytest.mark.parametrize(("free_gib", "status"), [(500, Status.PASS), (10, Status.WARN), (0.5, Status.FAIL)])
def test_disk(
    roots: Roots, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free_gib: float, status: Status
) -> None:
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: SimpleNamespace(free=free_gib * 2**30))
    ctx = ctx_for(roots, "login")
    ctx.disk_paths = (tmp_path,)
    result = storage.disk(ctx)
    assert result.status is status
    assert_fixable(result)


def test_python_version(monkeypatch: pytest.MonkeyPatch, roots: Roots) -> None:
    assert python_env.python_version(ctx_for(roots)).status is Status.PASS
    monkeypatch.setattr(
        python_env, "sys", SimpleNamespace(version_info=(3, 9, 18), executable="/usr/bin/python3")
    )
    result = python_env.python_version(ctx_for(roots))
    assert result.status is Status.FAIL and "3.9.18" in result.detail and result.fix
