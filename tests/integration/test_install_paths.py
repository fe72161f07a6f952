"""Every install path in the README works on its own: the built wheel, one extra at a time, in a scratch venv.

`make setup` installs every extra at once, so the rest of the suite cannot see an import that only another
extra declares. Here the wheel is built once (sdist first, then the wheel from it, as a release would be),
and each path gets a venv of its own without the system site-packages and without PYTHONPATH, so only what
the wheel and its declared dependencies bring is importable. torch comes from the local CPU wheel through
pip's own configuration (find-links), as in `make setup`; downloads go through pip's cache.

Where the time went (2 shared cores): seeding pip into each venv (ensurepip, 30-50 s a venv under load), three
torch installs and a torch launch only to make a checkpoint. So the venvs are made without pip and the test's
own pip installs into each (`pip --python`: same resolver, same wheelhouse, nothing of pip's left in the venv);
the [train] venv's own one-process run is the checkpoint the others verify, plot and export; and [train,hf] is
[train]'s venv with [hf] added after every [train] check has run in it (the same packages a fresh
`pip install 'hpkit[train,hf]'` brings, from the same wheelhouse).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml
from test_check_prereqs import _closed_port

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[2]
# What a source release holds; everything else in the checkout must not be needed to build.
SOURCES = ("pyproject.toml", "README.md", "python", "slurm/templates")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    started = time.monotonic()
    # --no-isolation: the dev extra already has the build backend; an isolated build would fetch it again.
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("hpkit-*.whl")
    print(f"built {built.name} (sdist, then wheel) in {time.monotonic() - started:.1f} s")
    return built


@pytest.fixture(scope="module")
def wheelhouse(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every extra's dependencies, resolved once through pip's own configuration (torch from the local wheel).

    Each venv then installs from here alone, so no install waits on the index, and each still resolves only
    what its own extra declares: a missing declaration fails as it would for a user.
    """
    started = time.monotonic()
    house = tmp_path_factory.mktemp("wheelhouse")
    extras = ",".join(_extras())
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(house), f"{wheel}[{extras}]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"wheelhouse for [{extras}] filled in {time.monotonic() - started:.1f} s")
    return house


def _extras() -> list[str]:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [name for name in declared["optional-dependencies"] if name != "dev"]


@dataclass
class Venv:
    root: Path
    env: dict[str, str]
    cwd: Path

    def run(self, *argv: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv),
            env={**self.env, **env},
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *argv: str, timeout: float = 300) -> str:
        return _ok(self.run(*argv, timeout=timeout))

    def importable(self, module: str) -> bool:
        return self.run("python", "-c", f"import {module}").returncode == 0


def _venv(tmp: Path, wheel: Path, house: Path, extra: str | None) -> Venv:
    started = time.monotonic()
    root = tmp / "venv"
    # --without-pip: nothing here runs pip from inside the venv, and ensurepip was the slowest step of a light venv.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "HPKIT_SPEC")
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PATH=f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(root),
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        # Never the real 169.254.169.254: the metadata probe goes to a closed local port.
        AWS_EC2_METADATA_SERVICE_ENDPOINT=_closed_port(),
    )
    venv = Venv(root, env, tmp)
    _install(venv, wheel, house, extra)
    where = venv.ok("python", "-c", "import hpkit; print(hpkit.__file__)").strip()
    assert Path(where).is_relative_to(root), f"hpkit came from {where}, not the venv"
    print(f"venv {extra or 'core'}: installed in {time.monotonic() - started:.1f} s")
    return venv


def _install(venv: Venv, wheel: Path, house: Path, extra: str | None) -> None:
    """pip resolves the extra's declared requirements against the wheelhouse alone and installs into the venv."""
    requirement = f"{wheel}[{extra}]" if extra else str(wheel)
    # --no-compile: byte-compiling all of torch up front costs more than the few modules a run imports.
    venv.ok(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(venv.root / "bin" / "python"),
        "install",
        "--quiet",
        "--no-compile",
        "--no-index",
        "--find-links",
        str(house),
        requirement,
        timeout=600,
    )


@dataclass
class TrainVenv:
    """The [train] venv and what ran in it while [train] alone was installed."""

    venv: Venv
    docker_importable: bool
    one: subprocess.CompletedProcess
    two: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def train_venv(wheel: Path, wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainVenv:
    """Both runs happen here, before the hf test can add [hf] to this venv, whichever test asks first; the
    train test asserts on them. The one-process run is also the checkpoint and metrics of `trained`."""
    tmp = tmp_path_factory.mktemp("train")
    venv = _venv(tmp, wheel, wheelhouse, "train")
    docker = venv.importable("docker")
    one = venv.run("hpkit", "train", "--config", str(_train_config(tmp, "one")))
    two = venv.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "hpkit",
        "train",
        "--config",
        str(_train_config(tmp, "two")),
    )
    return TrainVenv(venv, docker, one, two)


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, (
        f"{done.args}: exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def trained(train_venv: TrainVenv) -> tuple[Path, Path]:
    """A checkpoint and a metrics file from the [train] venv's 2-step run on one process: what the venvs below
    verify, plot and export without training themselves."""
    _ok(train_venv.one)
    tmp = train_venv.venv.cwd
    (metrics,) = (tmp / "out").glob("install-one-*.metrics.jsonl")
    return tmp / "ckpt-one", metrics


def test_core_checks_and_renders_from_the_wheel(
    wheel: Path, wheelhouse: Path, tmp_path: Path, trained: tuple[Path, Path]
) -> None:
    venv = _venv(tmp_path, wheel, wheelhouse, None)
    assert not venv.importable("torch")

    done = venv.run("hpkit", "check", "--json", timeout=60)
    assert done.returncode in (0, 1), done.stderr
    checks = {row["name"]: row["status"] for row in json.loads(done.stdout)["checks"]}
    assert checks and done.returncode == (1 if "FAIL" in checks.values() else 0)

    # The templates come from the installed package: nothing of the checkout is on this venv's path.
    template_dir = Path(
        venv.ok("python", "-c", "import hpkit.slurm.script as s; print(s.TEMPLATE_DIR)").strip()
    )
    assert template_dir.is_relative_to(venv.root) and (template_dir / "train.sbatch.j2").is_file()
    script = venv.ok("hpkit", "render", str(REPO / "slurm" / "jobs" / "demo.yaml"))
    assert script.startswith("#!/bin/bash\n# Run with: sbatch demo.sbatch\n")
    assert "world size 4, launcher torchrun" in script
    nccl = venv.ok("hpkit", "bench", "nccl-tests", "render", "--nodes", "1", "--gpus-per-node", "1")
    assert nccl.startswith("#!/bin/bash") and "all_reduce_perf" in nccl

    # pyproject promises `hpkit ckpt verify` without torch: a login node checks a checkpoint before a resume.
    checkpoints, _ = trained
    ok = venv.ok("hpkit", "ckpt", "verify", str(checkpoints))
    assert "step-00000002: ok" in ok, ok
    copy = tmp_path / "ckpt-copy"
    shutil.copytree(checkpoints, copy)
    (data,) = (copy / "step-00000002").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, size unchanged
    data.write_bytes(bytes(raw))
    bad = venv.run("hpkit", "ckpt", "verify", str(copy))
    assert bad.returncode != 0, bad.stdout
    assert "Traceback" not in bad.stderr and data.name in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def _train_config(tmp: Path, tag: str) -> Path:
    config = {
        "name": f"install-{tag}",
        "output_dir": str(tmp / "out"),
        "model": {
            "name": "debug",
            "dim": 32,
            "n_layers": 2,
            "n_heads": 2,
            "ffn_dim": 64,
            "vocab_size": 128,
            "seq_len": 16,
        },
        "train": {"steps": 2, "local_batch_size": 2, "mixed_precision": "fp32"},
        "checkpoint": {"dir": str(tmp / f"ckpt-{tag}")},
    }
    path = tmp / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_train_extra_trains_on_one_process_and_under_torchrun(train_venv: TrainVenv) -> None:
    assert not train_venv.docker_importable

    one = _ok(train_venv.one)
    assert "hpkit train: done steps=2 " in one and " world=1 " in one, one

    two = _ok(train_venv.two)
    assert "hpkit train: done steps=2 " in two and " world=2 " in two, two


def test_plot_extra_plots_a_training_run(
    wheel: Path, wheelhouse: Path, tmp_path: Path, trained: tuple[Path, Path]
) -> None:
    venv = _venv(tmp_path, wheel, wheelhouse, "plot")
    assert not venv.importable("torch")
    _, metrics = trained
    venv.ok("hpkit", "plot", str(metrics), "-o", str(tmp_path / "run.png"))
    venv.ok("hpkit", "plot", str(metrics), "-o", str(tmp_path / "run.svg"))
    png = (tmp_path / "run.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, len(png)
    svg = (tmp_path / "run.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "loss" in svg


def test_train_hf_extras_export_and_start_from_the_export(
    wheel: Path, wheelhouse: Path, tmp_path: Path, trained: tuple[Path, Path], train_venv: TrainVenv
) -> None:
    """docs/finetuning.md's path: `hpkit ckpt export --hf`, then `model.init_from` of what it wrote."""
    venv = train_venv.venv  # its [train] runs are done (the fixture): from here on it is a [train,hf] venv
    _install(venv, wheel, wheelhouse, "train,hf")
    checkpoints, _ = trained
    exported = tmp_path / "hf"
    venv.ok("hpkit", "ckpt", "export", "--hf", str(checkpoints), str(exported))
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2, config
    assert list(exported.glob("*.safetensors")), sorted(p.name for p in exported.iterdir())

    path = _train_config(tmp_path, "from-hf")
    spec = yaml.safe_load(path.read_text())
    spec["model"] = {"init_from": str(exported), "seq_len": 16}
    path.write_text(yaml.safe_dump(spec))
    out = venv.ok("hpkit", "train", "--config", str(path))
    assert "hpkit train: done steps=2 " in out, out
    # Same shape (from config.json), seed and data as the fixture's run: had the weights not been loaded,
    # the fresh init would give the fixture's first loss exactly.
    (mine,) = (tmp_path / "out").glob("install-from-hf-*.metrics.jsonl")
    assert _first_loss(mine) != _first_loss(trained[1]), (_first_loss(mine), _first_loss(trained[1]))


def _first_loss(metrics: Path) -> float:
    records = (json.loads(line) for line in metrics.read_text().splitlines())
    return next(r["loss"] for r in records if r.get("step") == 1 and "loss" in r)


def test_image_extra_shows_help_and_says_when_no_engine_answers(
    wheel: Path, wheelhouse: Path, tmp_path: Path
) -> None:
    venv = _venv(tmp_path, wheel, wheelhouse, "image")
    assert not venv.importable("torch")

    assert "--cpu" in venv.ok("hpkit", "image", "build", "--help")
    done = venv.run(
        "hpkit",
        "image",
        "build",
        "--context",
        str(REPO),
        DOCKER_HOST=f"unix://{tmp_path}/nothing.sock",
    )
    assert done.returncode == 1 and done.stdout == "", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hpkit image: error: no container engine answers at DOCKER_HOST=")


_TINY_CORPUS = """
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers
root = Path(sys.argv[1])
tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
(root / "tok").mkdir()
tok.save(str(root / "tok" / "tokenizer.json"))
(root / "in.jsonl").write_text(json.dumps({"text": "a b a"}) + "\\n" + json.dumps({"text": "b"}) + "\\n")
"""


def test_data_extra_prepares_without_torch(wheel: Path, wheelhouse: Path, tmp_path: Path) -> None:
    venv = _venv(tmp_path, wheel, wheelhouse, "data")
    assert not venv.importable("torch")
    venv.ok("python", "-c", _TINY_CORPUS, str(tmp_path))
    out = venv.ok(
        "hpkit", "data", "prepare", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok"),
        "--out", str(tmp_path / "out"), "--workers", "2",
    )  # fmt: skip
    assert "6 tokens in 1 shards, 2 documents" in out, out
    assert (tmp_path / "out" / "shard-00000.bin").read_bytes() == bytes([1, 0, 2, 0, 1, 0, 3, 0, 2, 0, 3, 0])


@pytest.mark.parametrize(
    ("extra", "example"),
    [("mpi", "hpkit.examples.mpi_collectives"), ("lightning", "hpkit.examples.lightning_ddp")],
)
def test_example_extras_import_their_examples(
    wheel: Path, wheelhouse: Path, tmp_path: Path, extra: str, example: str
) -> None:
    venv = _venv(tmp_path, wheel, wheelhouse, extra)
    # Open MPI's singleton start (mpi4py initialises MPI on import) refuses root unless told otherwise.
    venv.env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    venv.ok("python", "-c", f"import {example}")
