"""How often an unchanged DDP script on gloo aborts at exit, launched as users write it and through hpkit's
launch wrapper (`python -m hpkit.run_script`), side by side.

The script is seed 002's plain DDP script (tests/integration/sagemaker_scripts/ddp_smddp.py without its
SageMaker SDP import, with --backend gloo): no shim, no hpkit import, no change. Each trial is one
`torchrun --nproc-per-node 2` launch; the sides alternate so that the machine's load is shared. An abort
is a launch that failed or whose output says "terminate called" (the race hpkit.exit_settle explains).

    python bench/bench_exit_aborts.py --trials 50
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hpkit.rendezvous import free_local_ports

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "tests/integration/sagemaker_scripts"
SDP_IMPORT = "import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401\n"


def plain_ddp_script(folder: Path) -> Path:
    """The seed's DDP script before its SageMaker SDP change: the SDP import is the one line it adds."""
    text = (SEED / "ddp_smddp.py").read_text()
    assert SDP_IMPORT in text, "the seed script changed: update SDP_IMPORT"
    script = folder / "ddp.py"
    script.write_text(text.replace(SDP_IMPORT, ""))
    shutil.copy(SEED / "weights.py", folder / "weights.py")
    return script


def trial(script: Path, wrapped: bool, out: Path) -> tuple[bool, str]:
    program = [sys.executable, *(["-m", "hpkit.run_script"] if wrapped else []), str(script)]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "python"),
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
        "SM_OUTPUT_DATA_DIR": str(out),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            f"--master-port={free_local_ports()}", "--no-python", *program, "--backend", "gloo", "--epochs", "2",
        ],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    text = done.stdout + done.stderr
    aborted = done.returncode != 0 or "terminate called" in text
    return aborted, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="launches per side (default 50)")
    args = parser.parse_args()
    aborts = {"as written": 0, "hpkit.run_script": 0}
    done_trials = {"as written": 0, "hpkit.run_script": 0}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        script = plain_ddp_script(folder)
        for i in range(args.trials):
            for name, wrapped in (("as written", False), ("hpkit.run_script", True))[:: 1 if i % 2 else -1]:
                aborted, text = trial(script, wrapped, folder / "out")
                done_trials[name] += 1
                if aborted:
                    aborts[name] += 1
                    last = [line for line in text.splitlines() if line.strip()][-1:]
                    print(f"trial {i + 1} {name}: aborted: {last}", flush=True)
            print(f"round {i + 1}/{args.trials}: aborts {aborts}", flush=True)
    for name, count in aborts.items():
        print(f"{name:>17}: {count} of {done_trials[name]} launches aborted at exit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
