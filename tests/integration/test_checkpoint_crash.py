"""Checkpoints under SIGKILL and corruption: a resume always starts from a complete checkpoint.

Saves every step. A 2-rank run is killed (both ranks, back to back, as a node crash would) at the moment a
save is in progress: when its `.tmp` directory appears, when shard files appear in it, when DCP's
`.metadata` lands in it. Each restart must resume from the newest checkpoint committed before its
kill, and every run's losses, not only the last one's, must equal those of a run never interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _torchrun
import pytest
import yaml
from _dirwatch import DirWatch

from hpkit.rendezvous import free_local_ports
from hpkit.runtime.checkpoints.checkpoint import find_latest

pytestmark = pytest.mark.dist

# The kills below land by about step 8 (each run resumes a step or two past the last); the final run trains the rest,
# saving every step (1-4 s a step on a loaded machine).
STEPS = 20
REPO = Path(__file__).resolve().parents[2]
TMP_DIR = re.compile(r"^step-(\d{8})\.tmp$")
COMMITTED_DIR = re.compile(r"^step-(\d{8})$")


def config(tmp_path: Path, name: str, steps: int = STEPS) -> Path:
    data = {
        "name": name,
        "output_dir": str(tmp_path / "logs"),
        "model": {"name": "debug", "n_layers": 2, "seq_len": 16},
        "train": {
            "steps": steps,
            "local_batch_size": 1,
            "lr": 0.003,
            "mixed_precision": "fp32",
            "seed": 5,
            "metrics_file": str(tmp_path / f"{name}.jsonl"),
            "tensorboard": False,
        },
        "checkpoint": {"dir": str(tmp_path / f"{name}-ckpt"), "interval": 1, "keep": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    return env


def launch(cfg: Path) -> subprocess.Popen:
    env = clean_env()
    return subprocess.Popen(
        _torchrun.warm([sys.executable, "-m", "hpkit", "train", "--config", str(cfg)], env),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@dataclass
class Run:
    """Two ranks, each forked by this test process's zygote (_torchrun.warm) behind a client that exits as it does,
    or started cold; rank 0's output in a file."""

    procs: list[subprocess.Popen]  # what this process started: each rank's client, or the rank itself
    ranks: list[int]  # the ranks' own pids (_torchrun.rank_pid)
    log: Path

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> list[int]:
        return [proc.wait(timeout=timeout) for proc in self.procs]

    def kill(self) -> None:
        """SIGKILL both ranks themselves, back to back."""
        _torchrun.sigkill(self.ranks)


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a listening TCP socket on `port` (its fds' socket inodes in /proc/net/tcp*)."""
    try:
        inodes = {
            os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        }
        # The store may listen on an IPv6 socket that also takes IPv4 (libuv): both tables.
        rows = [
            line.split()
            for table in ("/proc/net/tcp", "/proc/net/tcp6")
            for line in Path(table).read_text().splitlines()[1:]
        ]
    except OSError:  # the process is gone, or an fd closed between listing and reading
        return False
    # local_address is ADDR:PORT in hex, st 0A is LISTEN, the inode is the tenth column.
    return any(int(r[1].split(":")[1], 16) == port and r[3] == "0A" and r[9] in inodes for r in rows)


def launch_2_ranks(cfg: Path, log: Path) -> Run:
    """Rank 0 first, on a free port; rank 1 once rank 0's store listens there. Another test on this host may take
    the port between choosing and binding it: then rank 0 stops with EADDRINUSE and a new port is tried (it is not
    the fault under test)."""
    for _ in range(5):
        port, procs, ranks = free_local_ports(), [], []
        for rank in range(2):
            env = clean_env()
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            cmd = _torchrun.warm([sys.executable, "-m", "hpkit", "train", "--config", str(cfg)], env)
            since = time.monotonic()
            with log.with_suffix(f".rank{rank}").open("w") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            ranks.append(_torchrun.rank_pid(procs[-1], since))
            if rank == 1:
                return Run(procs, ranks, log.with_suffix(".rank0"))
            deadline = time.monotonic() + 120
            while procs[0].poll() is None and not _listens(ranks[0], port):
                if time.monotonic() > deadline:
                    Run(procs, ranks, log).kill()
                    raise AssertionError("rank 0 never listened on its port")
                time.sleep(0.05)
            if procs[0].poll() is not None:
                break  # rank 0 ended before it listened: the port, or not
        output = log.with_suffix(".rank0").read_text()
        assert "EADDRINUSE" in output or "in use" in output, output
    raise AssertionError(f"no free port held for rank 0 in 5 tries:\n{output}")


def losses(path: Path, start: int = 0) -> dict[int, float]:
    """step -> loss from byte `start` on (one run's records); a step logged twice keeps its last value."""
    out = {}
    text = path.read_bytes()[start:].decode() if path.exists() else ""
    for line in text.splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def newest_committed(root: Path) -> int | None:
    steps = [int(m.group(1)) for e in os.scandir(root) if (m := COMMITTED_DIR.match(e.name)) and e.is_dir()]
    return max(steps, default=None)


@dataclass
class Kill:
    tmp: Path  # the save in progress when the kill landed
    contents: list[str]  # what that save had written by then
    newest_committed: int | None


PHASES = {
    "created": lambda tmp: tmp.is_dir(),
    "writing": lambda tmp: any(e.is_file() for e in os.scandir(tmp)) if tmp.is_dir() else False,
    "metadata": lambda tmp: (tmp / ".metadata").is_file(),
}


def kill_during_save(run: Run, root: Path, nth: int, phase: str, timeout: float = 240) -> Kill:
    """SIGKILL every rank the moment this run's `nth` save reaches `phase` (while its .tmp exists)."""
    reached = PHASES[phase]
    deadline = time.monotonic() + timeout
    created, target = 0, None
    with DirWatch() as watch:
        assert watch.add(root)
        while True:
            for parent, name, is_dir in watch.events(0.2):
                # A leftover .tmp from the previous kill is renamed aside at start (a move out, no event).
                if parent == root and is_dir and TMP_DIR.match(name):
                    created += 1
                    if created >= nth and target is None:
                        target = root / name
                        watch.add(target)  # its files from now on; those before are seen by `reached`
            if target is not None:
                if reached(target):
                    run.kill()
                    break
                if not target.is_dir():  # committed before it reached the phase: take the next save
                    target = None
            exited = [p.returncode for p in run.procs if p.poll() is not None]
            assert not exited, (
                f"the run ended ({exited}) before its save {nth} reached {phase}:\n{run.output()}"
            )
            assert time.monotonic() < deadline, f"no save reached {phase} in {timeout} s:\n{run.output()}"
    assert run.wait(60) == [-signal.SIGKILL] * 2
    # The ranks are dead, so nothing can have renamed or added to the directory since the kill.
    assert target.is_dir(), f"{target} was gone by the kill: the kill missed the save"
    return Kill(target, sorted(os.listdir(target)), newest_committed(root))


def resume_step(output: str) -> int | None:
    found = re.findall(r"hpkit train: resumed from (\S+) at step (\d+)", output)
    assert len(found) <= 1, output
    return int(found[0][1]) if found else None


def test_sigkill_during_saves_never_breaks_resume(tmp_path):
    reference = launch_2_ranks(config(tmp_path, "reference"), tmp_path / "reference.log")
    cfg = config(tmp_path, "crashy")
    root = tmp_path / "crashy-ckpt"
    root.mkdir()
    metrics = tmp_path / "crashy.jsonl"
    # (which save of the run, which moment of it): shards half written, the metadata, a bare directory.
    plan = [(3, "created"), (2, "writing"), (2, "metadata"), (1, "created")]
    kills: list[Kill] = []
    runs: list[tuple[str, dict[int, float]]] = []
    for i, (nth, phase) in enumerate([*plan, (None, None)]):
        start = metrics.stat().st_size if metrics.exists() else 0
        run = launch_2_ranks(cfg, tmp_path / f"crashy-{i}.log")
        if phase is None:
            assert run.wait(300) == [0, 0], run.output()
        else:
            kill = kill_during_save(run, root, nth, phase)
            step = int(TMP_DIR.match(kill.tmp.name).group(1))
            assert kill.newest_committed is None or kill.newest_committed < step, kill
            if phase == "metadata":
                assert ".metadata" in kill.contents, kill
            if phase == "writing":
                assert kill.contents, kill
            kills.append(kill)
            pointer = root / "latest"
            if pointer.exists():
                named = root / pointer.read_text().strip()
                # `latest` may lag a committed rename, but never names something incomplete.
                assert (named / ".metadata").is_file(), f"latest names an incomplete checkpoint: {named}"
        output = run.output()
        resumed = resume_step(output)
        expected_resume = kills[i - 1].newest_committed if i else None
        assert resumed == expected_resume, f"run {i} resumed at {resumed}, not {expected_resume}:\n{output}"
        got = losses(metrics, start)
        first = (resumed or 0) + 1
        last = STEPS if phase is None else int(TMP_DIR.match(kills[-1].tmp.name).group(1))
        # Each step is logged before its save, so the run got at least to the step it was saving.
        assert sorted(got)[:1] == [first] and max(got) >= last, (i, sorted(got))
        assert sorted(got) == list(range(first, max(got) + 1)), (i, sorted(got))
        runs.append((output, got))

    print("kills:", *kills, sep="\n  ")  # shown with -s or on failure: where each kill landed
    assert f"done steps={STEPS}" in runs[-1][0]
    assert find_latest(root) == root / f"step-{STEPS:08d}"
    assert reference.wait(300) == [0, 0], reference.output()
    expected = losses(tmp_path / "reference.jsonl")
    assert sorted(expected) == list(range(1, STEPS + 1))
    for i, (_, got) in enumerate(runs):
        for step, loss in got.items():
            assert loss == pytest.approx(expected[step], rel=1e-6), f"run {i}, step {step}"


def test_a_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    cfg = config(tmp_path, "corrupt", steps=6)
    first = launch(cfg)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    root = tmp_path / "corrupt-ckpt"
    newest = find_latest(root)
    assert newest is not None and newest.name == "step-00000006"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # a torn write

    cfg.write_text(cfg.read_text().replace("steps: 6", "steps: 8"))
    again = launch(cfg)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert re.search(
        rf"skipping checkpoint {re.escape(str(newest))}: __0_0\.distcp: 100 bytes, the record says \d+", out
    ), out
    assert "resumed from" in out and "step-00000005 at step 5" in out
    assert "done steps=8" in out


def test_a_full_disk_ends_the_run_with_one_line_and_no_partial_checkpoint(tmp_path):
    import resource

    cfg = config(tmp_path, "full", steps=4)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID")}

    def small_files() -> None:  # every file this process writes stops at 1 MiB: the disk is "full"
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    proc = subprocess.run(
        [sys.executable, "-m", "hpkit", "train", "--config", str(cfg)],
        env=env,
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpkit train: error:")]
    assert len(errors) == 1, proc.stderr
    assert "could not write checkpoint step-00000001" in errors[0]
    assert "no checkpoint is complete yet" in errors[0] and "has room" in errors[0]
    root = tmp_path / "full-ckpt"
    assert list(root.iterdir()) == [], "the failed save left files behind"
