"""`hpkit plan --goodput`: expected goodput at 1k, 4k and 16k GPUs, persistent checkpoints only against
in-memory recovery, at the checkpoint intervals that maximise it (the model: hpkit.plan.goodput).

    hpkit plan --goodput [MODEL] [--instance TYPE] [--nodes N] [--fault-rate R] [--restart-s S] ... [--json]

Its own module so that `commands/plan.py` only adds the flags and hands over. Every field of
`GoodputInputs` is a flag of the same name; a flag left out keeps the field's default (stated with its source
in the module).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from hpkit.errors import SpecError

# What each flag means, for --help; {default} is GoodputInputs' own default (stated with its source there).
HELP = {
    "fault_rate": "unexpected interruptions per node-hour (default {default:.3g}: Llama 3's, 419 in 54 days on "
    "2,048 nodes)",
    "state_bytes": "checkpoint state of the whole job, bytes (default {default:.3g}: 70B x 12 bytes; with MODEL, "
    "its parameters x 12)",
    "fs_read_gbs": "shared file system's aggregate read rate, GB/s (default {default:g}: FSx for Lustre, "
    "BENCHMARKS.md)",
    "fs_write_gbs": "its aggregate write rate, GB/s (default {default:g})",
    "node_fs_gbs": "one node's own file system rate, GB/s (default {default:g})",
    "save_efficiency": "a save's rate as a fraction of the write rate (default {default:g}, measured against dd)",
    "ckpt_write_s": "seconds a persistent checkpoint blocks training (default: state / write rate, a sync save)",
    "restore_s": "seconds to read the state back from the file system (default: state / read rate)",
    "detection_s": "seconds from a fault to the node named (default {default:g}, measured)",
    "restart_s": "seconds from the node named to the next step: spare, processes, rendezvous (default "
    "{default:g}, measured)",
    "memory_restart_s": "the same before an in-memory restore (default: --restart-s)",
    "step_s": "seconds a training step takes (default {default:g})",
    "copy_cost": "blocking cost of one in-memory copy, a fraction of a step (default {default:g})",
    "link_gbps": "rate a node pulls its lost state from its partner, Gb/s (default {default:g}: EFA on p5; "
    "with --instance, its own)",
    "unrecoverable": "fraction of faults no node's RAM survives (default {default:g})",
    "ckpt_interval": "fix the persistent checkpoint interval, steps (default: the best)",
    "memory_every": "fix the in-memory copy interval, steps (default: the best)",
}
_SET_ELSEWHERE = {"gpus_per_node"}  # from --instance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hpkit.plan.goodput import GoodputInputs

    group = parser.add_argument_group(
        "goodput (--goodput: expected goodput under node faults, persistent checkpoints only vs in-memory "
        "recovery; MODEL optional)"
    )
    group.add_argument(
        "--goodput",
        action="store_true",
        help="print expected goodput at 1k/4k/16k GPUs (--nodes N: at N only), persistent-only vs in-memory "
        "recovery, with the checkpoint intervals that maximise it",
    )
    for f in fields(GoodputInputs):
        if f.name in _SET_ELSEWHERE:
            continue
        whole = f.name in ("ckpt_interval", "memory_every")
        # Plain numbers here, checked by GoodputInputs: bad input is then one line naming the flag.
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f"goodput_{f.name}",
            type=_whole if whole else _number,
            metavar="N" if whole else "X",
            help=HELP[f.name].format(default=f.default).replace("%", "%%"),
        )


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _whole(text: str) -> float:
    value = _number(text)
    return int(value) if value == int(value) else value


def inputs_of(args: argparse.Namespace) -> Any:
    from hpkit.plan.goodput import GoodputInputs

    given: dict[str, Any] = {}
    for f in fields(GoodputInputs):
        value = getattr(args, f"goodput_{f.name}", None)
        if value is not None:
            given[f.name] = value
    if args.instance:
        from hpkit import catalog

        row, links = catalog.lookup(args.instance), catalog.links(args.instance)
        if row is None or links is None:
            known = ", ".join(sorted(catalog.LINKS))
            raise SpecError(
                f"--instance {args.instance}: unknown to the planner's catalog: choose one of {known}"
            )
        given["gpus_per_node"] = row.gpus
        given.setdefault("link_gbps", float(links.efa_gbps))
    if args.target and "state_bytes" not in given:
        from hpkit.plan.shapes import resolve_model

        # fp32 weights and AdamW's two fp32 moments: 12 bytes a parameter (bf16 copies live in GPU memory only).
        given["state_bytes"] = float(resolve_model(args.target, 2048).params() * 12)
    return GoodputInputs(**given)


def main(args: argparse.Namespace) -> int:
    from hpkit.plan import goodput

    inputs = inputs_of(args)
    rows = goodput.table(inputs, [args.nodes] if args.nodes else None)
    target = goodput.target_case(inputs)
    if args.json:
        document = {
            "inputs": {k: v for k, v in vars(inputs).items()},
            "rows": [r.to_json() for r in rows],
            "target": {
                "gpus": goodput.TARGET_GPUS,
                "mtbf_h": goodput.TARGET_MTBF_H,
                "goodput_at_least": goodput.TARGET_GOODPUT,
                "persistent": target[0].to_json(),
                "in_memory": target[1].to_json(),
            },
        }
        print(json.dumps(document, indent=2))
    else:
        print(goodput.text(inputs, rows, target))
    return 0
