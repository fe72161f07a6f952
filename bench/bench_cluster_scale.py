"""The local cluster and a hang drill against the node count: how each phase grows from 2 to 64 nodes.

For each node count N: slurm/dev brings up an N-node cluster (NET=netns: an address per node, or loopback), and
`hpkit submit` runs a tiny `hpkit train` job on it with one rank per node through hpkit-torchrun and the hang
watchdog on. Before step 4 the last rank stops itself (HPKIT_FAULT stop: SIGSTOP); the watchdog names it and the
job ends (no restart left). Timed, per N:

- up: slurm/dev/up.sh until every node is idle; down: down.sh;
- submit -> first step: from just before `hpkit submit` to the first step record in the metrics file;
- rendezvous: from the supervisor's step_started event to the run's start record (every rank has imported
  torch, joined torchrun's rendezvous and the process group, and built the model);
- detection: from the SIGSTOP (the fault log's time) to the watchdog's verdict.json (its mtime).

A count whose job does not fit in memory gets the cluster timings only (--job-nodes-max). One rank per node
costs two torch processes (hpkit-torchrun's agent and the rank), about 0.5 GB together, and the host's two
cores import torch one after another: the job phases grow with N here mostly for that reason, not Slurm's.

    .venv/bin/python bench/bench_cluster_scale.py [--nodes 2,4,8,16,32,64] [--job-nodes-max 32] [--json PATH]

The integration test tests/integration/test_cluster_scale.py runs the same drill with a spare (`drill`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from hpkit import devcluster  # noqa: E402
from hpkit import job_events as ev  # noqa: E402
from hpkit.runtime.watchdog.hang_board import clear_reports  # noqa: E402

TINY_MODEL = {
    "name": "debug",
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 4,
    "ffn_dim": 64,
    "vocab_size": 128,
    "seq_len": 16,
}
HANG_MIN_S = 5.0


def spec(name: str, work: Path, step_nodes: int, spares: int, steps: int, interval: int) -> dict:
    """A tiny `hpkit train` job: one rank per step node, the hang watchdog on, `spares` spare nodes."""
    return {
        "name": name,
        "nodes": step_nodes,  # hpkit asks Slurm for the spares on top
        "tasks_per_node": 1,
        "launcher": "torchrun",
        "output_dir": str(work / "logs"),
        "command": [sys.executable, "-m", "hpkit", "train"],
        "parallelism": {"dp_shard": step_nodes},
        "model": TINY_MODEL,
        "train": {
            "steps": steps,
            "local_batch_size": 2,
            "lr": 0.01,
            "mixed_precision": "fp32",
            "seed": 3,
            "log_every": 1,
            "metrics_file": str(work / f"{name}.jsonl"),
            "tensorboard": False,
        },
        "checkpoint": {"dir": str(work / f"{name}-ckpt"), "interval": interval, "keep": 2},
        "resilience": {
            "max_restarts": 1 if spares else 0,
            "spare_nodes": spares,
            "collective_timeout_s": 120,
            # start_s: every rank imports torch and joins the rendezvous on two shared cores first.
            "hang": {"min_s": HANG_MIN_S, "start_s": 300},
        },
    }


@dataclass
class Drill:
    """One job's timeline (Unix seconds) and what the watchdog and the supervisor said."""

    job: str
    nodes: int
    submitted: float
    step_started: float | None = None
    ranks_up: float | None = None  # the metrics file's first start record
    first_step: float | None = None
    stopped: float | None = None
    stopped_rank: int | None = None
    stopped_node: str | None = None
    stopped_pid: int | None = None
    verdict_path: str | None = None
    verdict: dict = field(default_factory=dict)
    verdict_written: float | None = None
    state: str = ""
    events: list = field(default_factory=list)

    def phases(self) -> dict[str, float | None]:
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 2)

        return {
            "submit_to_first_step_s": span(self.submitted, self.first_step),
            "rendezvous_s": span(self.step_started, self.ranks_up),
            "detection_s": span(self.stopped, self.verdict_written),
        }


def _metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def job_state(job: str, env: dict[str, str]) -> str:
    text = subprocess.run(
        ["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    return next((w.split("=", 1)[1] for w in text.split() if w.startswith("JobState=")), "")


def submit(body: dict, work: Path, env: dict[str, str]) -> str:
    path = work / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    done = subprocess.run(
        [sys.executable, "-m", "hpkit", "submit", str(path)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"hpkit submit failed: {done.stderr.strip()}")
    return done.stdout.split("submitted job ")[1].split()[0]


def drill(
    env: dict[str, str],
    work: Path,
    step_nodes: int,
    spares: int = 0,
    steps: int = 100000,
    interval: int = 5,
    stop_at_step: int = 3,
    timeout_s: float = 600,
) -> Drill:
    """Submit the job whose last rank stops itself (SIGSTOP) once it has finished step `stop_at_step`, then
    wait for the job to end. Returns its timeline."""
    work.mkdir(parents=True, exist_ok=True)
    name = f"scale{step_nodes}"
    body = spec(name, work, step_nodes, spares, steps, interval)
    # The last rank (not on the store's node, rank 0's) stops itself before the step after `stop_at_step`: on the
    # event, whatever the load (a poll of the ranks' reports once missed a whole 40-step run on a busy machine).
    fault_log = work / "faults.jsonl"
    fault_log.unlink(missing_ok=True)
    body["env"] = {
        "HPKIT_FAULT": f"stop:rank={step_nodes - 1},step={stop_at_step + 1}",
        "HPKIT_FAULT_LOG": str(fault_log),
    }
    hangs = work / "logs" / "hangs"
    # A rerun with the same folder and job ids finds the last run's node-local reports: not this run's ranks.
    clear_reports(hangs)
    submitted = time.time()
    d = Drill(submit(body, work, env), step_nodes, submitted)
    metrics = work / f"{name}.jsonl"
    deadline = time.monotonic() + timeout_s
    state_due = 0.0
    try:
        while time.monotonic() < deadline:
            if d.first_step is None:
                for record in _metrics(metrics):
                    if record.get("event") == "start" and d.ranks_up is None:
                        d.ranks_up = record["time"]
                    if "loss" in record and record.get("step") == 1:
                        d.first_step = record["time"]
                        break
            if d.stopped is None:
                fired = _metrics(fault_log)  # JSON lines too
                if fired:
                    d.stopped = fired[0]["at"]
                    d.stopped_rank, d.stopped_node, d.stopped_pid = (
                        fired[0]["rank"],
                        fired[0]["node"],
                        fired[0]["pid"],
                    )
            if d.stopped is not None and d.verdict_path is None:
                found = sorted(hangs.glob(f"{d.job}-*/verdict.json"))
                if found:
                    try:
                        d.verdict = json.loads(found[0].read_text())
                    except ValueError:
                        d.verdict = {}  # being written
                    if d.verdict:
                        d.verdict_path = str(found[0])
                        d.verdict_written = found[0].stat().st_mtime
            # Slurm is asked once a second, the reports ten times: under load an scontrol call takes seconds, and a
            # poll that waits for it can miss the whole stretch of steps in which the ranks are to be stopped.
            if time.monotonic() >= state_due:
                state_due = time.monotonic() + 1.0
                d.state = job_state(d.job, env)
                if d.state and d.state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                    break
            time.sleep(0.1)
    finally:
        if d.stopped_pid is not None:
            # A stopped rank that outlived its step would hold its memory.
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(d.stopped_pid), signal.SIGCONT)
    path = ev.events_path(work / "logs", d.job)
    if path.exists():
        d.events = [e for _, _, e in ev.read(path.read_text().splitlines())]
    d.step_started = next((e["time"] for e in d.events if e["type"] == ev.STEP_STARTED), None)
    return d


def losses(metrics: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order written: a step re-run after a restart appears twice."""
    return [(r["step"], r["loss"]) for r in _metrics(metrics) if "loss" in r]


def cluster_env(work: Path, nodes: int, port: int, first_job_id: int, net: str) -> dict[str, str]:
    env = devcluster.client_env(work / "cluster", port, first_job_id, nodes=nodes, cpus=1, net=net)
    env.update(TMPDIR=str(work), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    return env


def _timed(fn, *args) -> float:
    started = time.monotonic()
    fn(*args)
    return round(time.monotonic() - started, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="2,4,8,16,32,64", help="node counts (2,4,8,16,32,64)")
    p.add_argument("--job-nodes-max", type=int, default=32, help="the largest count that runs the job (32)")
    p.add_argument("--net", default="netns", choices=devcluster.NET_LAYOUTS)
    p.add_argument("--port", type=int, default=8717, help="controller port; nodes take the next N (8717)")
    p.add_argument("--first-job-id", type=int, default=27000)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    rows = []
    for n in counts:
        work = Path(tempfile.mkdtemp(prefix=f"hpkit-bench-scale-{n}-"))
        env = cluster_env(work, n, args.port, args.first_job_id + 10 * len(rows), args.net)
        row: dict = {"nodes": n}
        try:
            row["up_s"] = _timed(devcluster.up, env)
            if n <= args.job_nodes_max:
                d = drill(env, work / "job", n)
                row.update(d.phases())
                # None: no rank was stopped (the job ended first: its state says how).
                row["named"] = bool(d.stopped_node) and d.stopped_node in (d.verdict.get("line") or "")
                row["state"] = d.state
        except Exception as exc:  # one count's failure is a row, not the end of the curve
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            row["down_s"] = _timed(devcluster.down, env)
        rows.append(row)
        print(json.dumps(row), flush=True)

    def cell(value) -> str:
        return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    cols = ("nodes", "up_s", "down_s", "submit_to_first_step_s", "rendezvous_s", "detection_s", "named")
    print("\n" + "  ".join(f"{c:>22}" if i else f"{c:>5}" for i, c in enumerate(cols)))
    for row in rows:
        print("  ".join(f"{cell(row.get(c)):>22}" if i else f"{row['nodes']:>5}" for i, c in enumerate(cols)))
    # The curve: each phase relative to the smallest count's.
    base = rows[0]
    for c in ("up_s", "submit_to_first_step_s", "rendezvous_s", "detection_s"):
        if base.get(c):
            ratios = [f"{r['nodes']}:{r[c] / base[c]:.1f}x" for r in rows if r.get(c) is not None]
            print(f"{c} vs {base['nodes']} nodes: {' '.join(ratios)}")
    if args.json:
        machine = f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}"
        args.json.write_text(json.dumps({"net": args.net, "machine": machine, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
