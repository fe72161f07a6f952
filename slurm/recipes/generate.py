"""Write the recipes: `hpkit plan --write` for each model x instance x node count, and the README table.

    .venv/bin/python slurm/recipes/generate.py

Llama 3 8B and 70B and Mixtral 8x7B (models/mixtral-8x7b.yaml) at seq 8192, one sequence per GPU a step, on
p4d.24xlarge, p5.48xlarge and p5en.48xlarge at 2, 4, 8 and 16 nodes. A combination that fits no layout gets
no spec; its README row says by how much the closest missed. tests/unit/test_plan_recipes.py checks that
each spec renders, validates and is judged as fitting; rerun this script when the planner's models change.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python"))

MODELS = {"llama3-8b": "8B", "llama3-70b": "70B", "mixtral-8x7b": "slurm/recipes/models/mixtral-8x7b.yaml"}
INSTANCES = ("p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge")
NODES = (2, 4, 8, 16)
SEQ = 8192


def plan(target: str, instance: str, nodes: int, write: Path | None) -> tuple[int, str, str]:
    from hpkit.cli import main

    argv = [
        "plan",
        target,
        "--instance",
        instance,
        "--nodes",
        str(nodes),
        "--seq",
        str(SEQ),
        "--top",
        "4",
        "--json",
    ]
    if write is not None:
        argv += ["--write", str(write.relative_to(REPO))]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def main() -> int:
    import os

    os.chdir(REPO)  # the spec comments name the command as run from the checkout
    rows = [
        "| model | instance | nodes | layout | GiB per GPU | tokens/s per GPU | MFU | spec |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tag, target in MODELS.items():
        for instance in INSTANCES:
            for nodes in NODES:
                path = HERE / f"{tag}-{instance.split('.')[0]}-{nodes}n.yaml"
                rc, out, err = plan(target, instance, nodes, path)
                if rc != 0:
                    path.unlink(missing_ok=True)
                    why = err.strip().split(": error: ", 1)[-1]
                    rows.append(f"| {tag} | {instance} | {nodes} | does not fit | | | | {why} |")
                    continue
                best = json.loads(out)["ranked"][0]
                speed = best["speed"]
                rows.append(
                    f"| {tag} | {instance} | {nodes} | {best['layout']} | {best['peak_gib']:.1f} | "
                    f"{speed['tokens_per_s_per_gpu']:,.0f} | {speed['mfu'] * 100:.1f}% | [{path.name}]({path.name}) |"
                )
    readme = HERE / "README.md"
    text = readme.read_text(encoding="utf-8")
    start, end = "<!-- recipes table -->\n", "<!-- end recipes table -->\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    readme.write_text(head + start + "\n".join(rows) + "\n" + end + tail, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
