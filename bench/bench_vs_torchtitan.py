"""hpkit's training runtime against torchtitan 0.2.2 on the same model, run alternately (issues 18, 27).

Same model (hpkit `model.name: debug` = torchtitan's llama3 debugmodel, 6,163,712 parameters), seq 256,
local batch 8, fp32, no activation checkpointing, AdamW lr 8e-4 with 2 warm-up steps, weight decay 0.1,
clip 1.0, OMP_NUM_THREADS=1, a loss logged every step on both sides. Three setups: one process, FSDP2
over 2 processes, dp_shard 2 x tp 2 over 4 processes. Two mixture-of-experts setups (issue 27): hpkit's
`debug-moe` against torchtitan's llama4 debugmodel, the same layout (dim 256, 6 blocks, 16 heads, vocab
2048; blocks 2, 4, 6 route to 8 experts of 512, top 1, plus 1 shared expert; the others a 768 FFN), one
process and ep 2 x dp_shard 2 over 4 processes (torchtitan: dp_shard 4, which its ep borrows from). The
routers differ in kind, not cost: torchtitan scores with a sigmoid and balances with a per-expert bias,
hpkit with Mixtral's softmax and an auxiliary loss. Each run's figure is global tokens per second from
the wall-clock time between consecutive logged steps (median over steps 3..N), the same measure on both
sides; the two sides alternate (A B A B ...) so that a shared machine's load falls on both alike.

    TITAN_DIR=/scratch/titan python3 bench/bench_vs_torchtitan.py [--setups single,fsdp2,dp2tp2,moe_single,moe_ep2dp2] [--rounds 3]
    TITAN_DIR=/scratch/titan python3 bench/bench_vs_torchtitan.py --profile   # one traced step per side/setup

TITAN_DIR must be prepared once as /work/shared/anchors/torchtitan/README.md says: a venv `venv022` with
torch 2.13.0 and torchtitan 0.2.2 (plus `triton`, which its MoE code imports even on CPU), and
`work/tests/assets/{tokenizer,c4_test}`. Without it this prints
why and exits 2; CI and `make test` never run it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "bench" / "torchtitan_cpu.py"
SEQ, LOCAL_BATCH, LR, WARMUP, WD, CLIP = 256, 8, 8e-4, 2, 0.1, 1.0


@dataclass(frozen=True)
class Setup:
    name: str
    procs: int
    dp: int  # ranks reading different data (hpkit: dp_shard x ep; torchtitan: dp_shard, which ep borrows from)
    tp: int
    moe: bool = False  # hpkit debug-moe against torchtitan's llama4 debugmodel
    ep: int = 1


SETUPS = {
    "single": Setup("single", 1, 1, 1),
    "fsdp2": Setup("fsdp2", 2, 2, 1),
    "dp2tp2": Setup("dp2tp2", 4, 2, 2),
    "moe_single": Setup("moe_single", 1, 1, 1, moe=True),
    "moe_ep2dp2": Setup("moe_ep2dp2", 4, 4, 1, moe=True, ep=2),
}


@dataclass
class Run:
    side: str
    setup: str
    tokens_per_s: float
    median_step_s: float
    fast_quartile_tokens_per_s: float  # from the 25th-percentile step: less sensitive to others' load
    first_loss: float
    last_loss: float
    load: float


# --------------------------------------------------------------------------------------------------
# The two sides


def hpkit_config(setup: Setup, steps: int, out: Path) -> dict:
    return {
        "name": f"anchor-{setup.name}",
        "output_dir": str(out),
        "parallelism": {"dp_shard": setup.dp // setup.ep, "ep": setup.ep, "tp": setup.tp},
        "model": {"name": "debug-moe" if setup.moe else "debug", "seq_len": SEQ},
        "train": {
            "steps": steps,
            "local_batch_size": LOCAL_BATCH,
            "lr": LR,
            "warmup_steps": WARMUP,
            "weight_decay": WD,
            "grad_clip": CLIP,
            "mixed_precision": "fp32",
            "activation_checkpoint": "none",
            "log_every": 1,  # torchtitan logs (and so reads the loss) every step here too
            "tensorboard": False,
            "metrics_file": "metrics.jsonl",
        },
    }


def titan_toml(setup: Setup, steps: int) -> str:
    # Only what differs from torchtitan 0.2.2's defaults for this comparison.
    return f"""[job]
print_config = false
[metrics]
log_freq = 1
disable_color_printing = true
[model]
name = "{"llama4" if setup.moe else "llama3"}"
flavor = "debugmodel"
hf_assets_path = "./tests/assets/tokenizer"
[optimizer]
name = "AdamW"
lr = {LR}
eps = 1e-8
weight_decay = {WD}
[lr_scheduler]
warmup_steps = {WARMUP}
[training]
local_batch_size = {LOCAL_BATCH}
seq_len = {SEQ}
max_norm = {CLIP}
steps = {steps}
dataset = "c4_test"
mixed_precision_param = "float32"
[parallelism]
data_parallel_shard_degree = {setup.dp}
tensor_parallel_degree = {setup.tp}
expert_parallel_degree = {setup.ep}
[activation_checkpoint]
mode = "none"
[checkpoint]
enable = false
"""


def _env(tmp: Path, src: Path | None = None) -> dict[str, str]:
    """The hpkit side runs this checkout, or `src` (another python/ folder, for before/after tables)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(src or REPO / "python"), env.get("PYTHONPATH")) if x)
    return env


def run_hpkit(
    setup: Setup, steps: int, tmp: Path, profile_step: int | None = None, src: Path | None = None
) -> Path:
    out = tmp / f"hpkit-{setup.name}" if src is None else tmp / f"hpkit-before-{setup.name}"
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"  # JSON is YAML: `hpkit train --config` reads it
    cfg_path.write_text(json.dumps(hpkit_config(setup, steps, out)))
    target = ["-m", "hpkit", "train", "--config", str(cfg_path)]
    if profile_step is not None:
        target = [str(Path(__file__).resolve()), "--hpkit-profile", str(cfg_path), str(profile_step)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(setup.procs)]
    log = out / "run.log"
    with log.open("w") as f:
        proc = subprocess.run(
            [*cmd, *target], env=_env(tmp, src), stdout=f, stderr=subprocess.STDOUT, cwd=REPO
        )
    if proc.returncode:
        raise RuntimeError(f"hpkit {setup.name} failed (exit {proc.returncode}): see {log}")
    return out


def run_titan(setup: Setup, steps: int, titan_dir: Path, tmp: Path, profile_step: int | None = None) -> Path:
    out = tmp / f"titan-{setup.name}"
    out.mkdir(parents=True, exist_ok=True)
    toml = out / "config.toml"
    toml.write_text(titan_toml(setup, steps))
    python = titan_dir / "venv022" / "bin" / "python"
    args = ["--job.config-file", str(toml), "--job.dump-folder", str(out)]
    if profile_step is not None:
        args += ["--profiling.enable-profiling", "--profiling.profile-freq", str(profile_step)]
        args += ["--profiling.profiler-warmup", "1", "--profiling.profiler-active", "1"]
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(setup.procs)]
    cmd += ["--local-ranks-filter", "0", "--role", "rank", str(SHIM), *args]
    log = out / "run.log"
    env = _env(tmp)
    env.pop("PYTHONPATH")  # torchtitan's venv, not hpkit's
    with log.open("w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=titan_dir / "work")
    if proc.returncode:
        raise RuntimeError(f"torchtitan {setup.name} failed (exit {proc.returncode}): see {log}")
    return out


# --------------------------------------------------------------------------------------------------
# Reading the runs: (step, loss, wall-clock time) per logged step


def hpkit_steps(out: Path) -> list[tuple[int, float, float]]:
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            rows.append((rec["step"], rec["loss"], rec["time"]))
    return rows


_TITAN_STEP = re.compile(r"^\[titan\] (\S+ \S+) - .*?step:\s*(\d+)\s+loss:\s*([\d.]+)")


def titan_steps(out: Path) -> list[tuple[int, float, float]]:
    rows = []
    for line in (out / "run.log").read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        line = line[line.find("[titan]") :] if "[titan]" in line else line
        m = _TITAN_STEP.match(line)
        if m:
            when = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            rows.append((int(m[2]), float(m[3]), when))
    return rows


def figure(side: str, setup: Setup, rows: list[tuple[int, float, float]], load: float) -> Run:
    by_step = {s: (loss, t) for s, loss, t in rows}
    last = max(by_step)
    # Step 1 and 2 pay for allocation and warm-up: the steady figure starts at step 3.
    gaps = [by_step[s][1] - by_step[s - 1][1] for s in range(3, last + 1)]
    med = statistics.median(gaps)
    q1 = statistics.quantiles(gaps, n=4)[0] if len(gaps) > 1 else med
    tokens = setup.dp * LOCAL_BATCH * SEQ
    return Run(side, setup.name, tokens / med, med, tokens / q1, by_step[1][0], by_step[last][0], load)


def load1() -> float:
    return os.getloadavg()[0]


# --------------------------------------------------------------------------------------------------
# Profiles: one steady step per side, summarised from the chrome trace by the same code on both sides

COLLECTIVE = re.compile(r"gloo|c10d::|all_gather|reduce_scatter|allreduce|all_reduce|record_param_comms|nccl")


def summarize_trace(path: Path) -> dict[str, float]:
    """Milliseconds of the main thread's profiled step by phase, from self times of nested CPU ops."""
    events = json.loads(path.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    steps = [e for e in ops if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise RuntimeError(f"{path}: no ProfilerStep in the trace")
    step = steps[-1]
    lo, hi = step["ts"], step["ts"] + step["dur"]
    # The autograd engine may run backward on its own thread: keep every thread, inside the step.
    inside = [
        e for e in ops if lo <= e["ts"] < hi and e is not step and not e["name"].startswith("ProfilerStep")
    ]
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in inside:
        by_tid[e["tid"]].append(e)
    phase = defaultdict(float)
    top = defaultdict(float)
    covered = 0.0
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[dict, list[str]]] = []
        selfs: dict[int, float] = {}
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                stack.pop()
            ctx = [s[0]["name"] for s in stack]
            if stack:
                selfs[id(stack[-1][0])] -= e["dur"]
            elif e["tid"] == step["tid"]:
                covered += e["dur"]
            selfs[id(e)] = e["dur"]
            stack.append((e, ctx))
            e["_ctx"] = ctx
        for e in evs:
            ms = selfs[id(e)] / 1000
            names = [*e["_ctx"], e["name"]]
            top[e["name"]] += ms
            phase[_phase(names)] += ms
    phase["host gaps (main thread, no op running)"] = max(0.0, (step["dur"] - covered) / 1000)
    phase["step (wall)"] = step["dur"] / 1000
    return {"phases": dict(phase), "top": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25])}


def _phase(names: list[str]) -> str:
    joined = " / ".join(names)
    if COLLECTIVE.search(joined) or "FSDP::" in joined:
        return "collectives (incl. waits)"
    if "Optimizer.step" in joined or "_fused_adam" in joined:
        return "optimizer"
    if "clip" in joined or "_foreach_norm" in joined or "linalg_vector_norm" in joined:
        return "grad norm + clipping"
    if "autograd::engine" in joined or "Backward" in joined or "backward" in joined:
        return "backward"
    if "zero_grad" in joined:
        return "zero_grad"
    return "forward + other"


def hpkit_profile_main(cfg_path: str, step: int) -> int:
    """Under torchrun: train with hpkit's Trainer and trace `step` (rank 0 writes the trace)."""
    import torch

    from hpkit.runtime.env import distributed

    try:
        from hpkit.runtime.loop.trainer import Trainer
    except ImportError:  # an earlier hpkit (--before) from before runtime/ had rooms
        from hpkit.runtime.trainer import Trainer  # type: ignore[no-redef]
    from hpkit.runtime.run import quiet_known_warnings
    from hpkit.spec import load_run_config

    quiet_known_warnings()
    cfg = load_run_config(cfg_path)
    with distributed() as job:
        trainer = Trainer(cfg, job.device)
        for _ in range(step - 1):
            trainer.train_step()
        with (
            torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
            ) as prof,
            torch.profiler.record_function(f"ProfilerStep#{step}"),
        ):
            trainer.train_step()
        if job.launch.rank == 0:
            prof.export_chrome_trace(str(Path(cfg.output_dir) / "trace.json"))
        trainer.close()
    return 0


def profile(setups: list[Setup], titan_dir: Path, tmp: Path, step: int, before: Path | None) -> None:
    for setup in setups:
        traces = {"hpkit": run_hpkit(setup, step, tmp, profile_step=step) / "trace.json"}
        if before is not None:
            traces["before"] = run_hpkit(setup, step, tmp, profile_step=step, src=before) / "trace.json"
        tt_dir = run_titan(setup, step, titan_dir, tmp, profile_step=step)
        traces["torchtitan"] = next(tt_dir.rglob("rank0_trace.json"))
        sums = {side: summarize_trace(path) for side, path in traces.items()}
        print(f"== profile {setup.name}: step {step}, rank 0, ms ({' | '.join(traces)})")
        for key in sorted({k for s in sums.values() for k in s["phases"]}):
            print(f"  {key:<42}" + "".join(f" {s['phases'].get(key, 0.0):9.1f}" for s in sums.values()))
        print(f"  top ops by self time ({' | '.join(traces)}):")
        names = list(dict.fromkeys(n for s in sums.values() for n in list(s["top"])[:15]))
        for n in names:
            print(f"    {n[:60]:<60}" + "".join(f" {s['top'].get(n, 0.0):9.1f}" for s in sums.values()))
        print(f"  traces: {' '.join(str(p) for p in traces.values())}", flush=True)


# --------------------------------------------------------------------------------------------------


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--titan-dir", default=os.environ.get("TITAN_DIR"), help="prepared torchtitan folder")
    p.add_argument("--setups", default="single,fsdp2,dp2tp2,moe_single,moe_ep2dp2")
    p.add_argument("--rounds", type=int, default=3, help="runs per side and setup, alternating")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="trace one steady step per side and setup instead")
    p.add_argument("--profile-step", type=int, default=8)
    p.add_argument("--keep", help="keep run folders here (default: a temporary folder)")
    p.add_argument("--json", help="also write every run as JSON lines to this file")
    p.add_argument("--before", help="also run an earlier hpkit from this python/ folder, as a third side")
    p.add_argument(
        "--max-load", type=float, default=2.5, help="wait for the 1-minute load to drop below this"
    )
    p.add_argument("--max-wait", type=float, default=120, help="seconds to wait for it before each run")
    return p.parse_args()


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--hpkit-profile":
        return hpkit_profile_main(sys.argv[2], int(sys.argv[3]))
    args = _parse()
    if not args.titan_dir:
        print(
            "bench_vs_torchtitan: set TITAN_DIR (or --titan-dir) to a prepared torchtitan folder",
            file=sys.stderr,
        )
        return 2
    titan_dir = Path(args.titan_dir).resolve()
    missing = [
        p
        for p in (
            "venv022/bin/python",
            "work/tests/assets/tokenizer/tokenizer.json",
            "work/tests/assets/c4_test",
        )
        if not (titan_dir / p).exists()
    ]
    if missing:
        print(f"bench_vs_torchtitan: TITAN_DIR={titan_dir} lacks {', '.join(missing)}: prepare it as "
              "/work/shared/anchors/torchtitan/README.md says", file=sys.stderr)  # fmt: skip
        return 2
    unknown = [s for s in args.setups.split(",") if s not in SETUPS]
    if unknown:
        print(f"bench_vs_torchtitan: --setups: unknown {', '.join(unknown)}: choose from {', '.join(SETUPS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    setups = [SETUPS[s] for s in args.setups.split(",")]
    with tempfile.TemporaryDirectory(prefix="hpkit-anchor-") as scratch:
        tmp = Path(args.keep).resolve() if args.keep else Path(scratch)
        if args.profile:
            profile(
                setups,
                titan_dir,
                tmp,
                args.profile_step,
                Path(args.before).resolve() if args.before else None,
            )
            return 0
        return compare(setups, titan_dir, tmp, args)


def wait_for_quiet(max_load: float, max_wait: float) -> float:
    """The machine may be shared: wait (a while) for the load to drop; returns the load at the start."""
    deadline = time.monotonic() + max_wait
    while load1() > max_load and time.monotonic() < deadline:
        time.sleep(10)
    return load1()


def compare(setups: list[Setup], titan_dir: Path, tmp: Path, args: argparse.Namespace) -> int:
    sides = ["hpkit", "torchtitan"] + (["hpkit-before"] if args.before else [])
    before = Path(args.before).resolve() if args.before else None
    runs: list[Run] = []
    for setup in setups:
        for r in range(args.rounds):
            # Rotate the order each round: no side always runs first, or always right after another.
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                load = wait_for_quiet(args.max_load, args.max_wait)
                start = time.monotonic()
                if side == "torchtitan":
                    run = figure(side, setup, titan_steps(run_titan(setup, args.steps, titan_dir, tmp)), load)
                else:
                    src = before if side == "hpkit-before" else None
                    out = run_hpkit(setup, args.steps, tmp, src=src)
                    run = figure(side, setup, hpkit_steps(out), load)
                runs.append(run)
                print(f"{setup.name:<7} round {r + 1} {side:<12} {run.tokens_per_s:8,.0f} tok/s "
                      f"(fast quartile {run.fast_quartile_tokens_per_s:,.0f})  "
                      f"median step {run.median_step_s:.3f} s  loss {run.first_loss:.3f} -> {run.last_loss:.3f}  "
                      f"load {load:.1f}  ({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
                if args.json:
                    with open(args.json, "a", encoding="utf-8") as f:
                        f.write(json.dumps(run.__dict__) + "\n")
    print(f"\nmedians of {args.rounds} runs (global tokens/s)")
    print(f"{'setup':<8}" + "".join(f"{side:>14}" for side in sides) + "  hpkit/torchtitan")
    for setup in setups:
        med = {
            side: statistics.median(r.tokens_per_s for r in runs if r.setup == setup.name and r.side == side)
            for side in sides
        }
        fast = {
            side: statistics.median(
                r.fast_quartile_tokens_per_s for r in runs if r.setup == setup.name and r.side == side
            )
            for side in sides
        }
        ratio = med["hpkit"] / med["torchtitan"]
        extra = f"  (before: {med['hpkit-before'] / med['torchtitan']:.3f})" if before else ""
        extra += f"  fast-quartile ratio {fast['hpkit'] / fast['torchtitan']:.3f}"
        extra += f"  median of per-round ratios {paired_ratio(runs, setup.name):.3f}"
        print(f"{setup.name:<8}" + "".join(f"{med[side]:14,.0f}" for side in sides) + f"  {ratio:.3f}{extra}")
        print(f"RATIO anchor_{setup.name} = {ratio:.3f}")
    return 0


def paired_ratio(runs: list[Run], setup: str) -> float:
    """Median over rounds of hpkit / torchtitan within a round: the two runs of a round are adjacent
    in time, so a machine whose speed drifts over minutes moves both alike."""
    hp = [r.tokens_per_s for r in runs if r.setup == setup and r.side == "hpkit"]
    tt = [r.tokens_per_s for r in runs if r.setup == setup and r.side == "torchtitan"]
    return statistics.median(a / b for a, b in zip(hp, tt, strict=True))


if __name__ == "__main__":
    sys.exit(main())
