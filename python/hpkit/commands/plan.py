"""`hpkit plan`: the layout that fits and runs fastest for a model on a cluster, or the verdict on a spec's.

    hpkit plan MODEL --instance TYPE --nodes N [--seq S] [--global-batch B | --global-tokens T] ...
    hpkit plan job.yaml [--instance TYPE] [--json]
    hpkit plan MODEL|job.yaml ... --trial K [--spec-base job.yaml]   # run the top K as short jobs
    hpkit plan [MODEL] --goodput [--nodes N] [--fault-rate R] ...     # goodput under faults (plan_goodput)


Torch-free (a login node runs it): the memory model (hpkit.plan.memory), the speed model (hpkit.plan.speed)
and the search (hpkit.plan.search) are arithmetic over the catalog's figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from hpkit.arg_types import positive_float, positive_int
from hpkit.commands import plan_goodput
from hpkit.errors import HpkitError, SpecError


def _parser(prog: str) -> argparse.ArgumentParser:
    from hpkit.plan.problem import DEFAULT_SEQ

    p = argparse.ArgumentParser(
        prog=prog,
        description="Rank every layout hpkit can run for MODEL on NODES x INSTANCE by predicted tokens/s per GPU, "
        "after rejecting those that do not fit a GPU's memory (by how many GiB) or that the runtime refuses "
        "(with its message). With a job spec instead of a model: that spec's layout, its peak memory per GPU "
        "and its speed.",
    )
    p.add_argument(
        "target",
        nargs="?",
        help="a shape name (8B, 70B, debug-moe, ...), a Hugging Face model folder (config.json: Llama, "
        "Mixtral), or a job spec (.yaml/.json) to judge",
    )
    p.add_argument("--instance", help="instance type of the nodes (p5.48xlarge; ml. prefix allowed)")
    p.add_argument("--nodes", type=positive_int, help="nodes of that type")
    p.add_argument("--seq", type=positive_int, help=f"sequence length (default {DEFAULT_SEQ}; a spec's own)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=positive_int, help="sequences per step (default: one per GPU)")
    batch.add_argument("--global-tokens", type=positive_int, help="tokens per step (a multiple of --seq)")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        help="mixed precision (default bf16; with --trial, a spec's own)",
    )
    p.add_argument("--top", type=positive_int, default=5, help="layouts to print (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--explain",
        action="store_true",
        help="print each term of the winner's (or the spec's) peak memory and step time with its formula's inputs",
    )
    p.add_argument("--write", metavar="JOB_YAML", help="write the winner as a job spec `hpkit submit` takes")
    p.add_argument(
        "--check-with-torch",
        action="store_true",
        help="also run torch's FSDPMemTracker (FakeTensor, no GPU) on the spec's layout, or on the best-ranked "
        "FSDP-only layout, and print its peak beside the planner's (imports torch: hpkit[train])",
    )
    p.add_argument(
        "--network",
        metavar="PAIRS_JSON",
        help="measured inter-node bandwidth: the pairs-JOB.json `hpkit check --all-nodes --bandwidth` wrote "
        "(its nodes' median best all_reduce busbw replaces the catalog's EFA figure)",
    )
    trial = p.add_argument_group("trials (submit the top layouts as short jobs and measure them)")
    trial.add_argument(
        "--trial",
        type=positive_int,
        metavar="K",
        help="submit the top K layouts as short jobs through `hpkit submit`'s path, wait, and print predicted "
        "and measured tokens/s and peak memory side by side, re-ranked by the measurement. With a job spec: "
        "the search is over that spec's model and world, and the jobs take its job fields",
    )
    trial.add_argument(
        "--spec-base",
        metavar="JOB_YAML",
        help="with MODEL --trial: the job spec whose job fields (partition, time_limit, output_dir, container, "
        "launcher, env, ...) the trials take (default: the cluster's defaults, named in one line)",
    )
    trial.add_argument(
        "--trial-steps",
        type=positive_int,
        default=8,
        metavar="N",
        help="steps each trial runs (default 8); the first 2 are warm-up, the median of the rest is measured",
    )
    trial.add_argument(
        "--poll",
        type=positive_float,
        default=2.0,
        metavar="S",
        help="seconds between Slurm polls (default 2)",
    )
    plan_goodput.add_arguments(p)
    return p


def _torch_check(shape: Any, cand: Any) -> dict[str, Any]:
    """torch's tracker on one layout, beside the planner's figure. Imported by name, as cli imports commands:
    torch loads only behind --check-with-torch, and the login-node contract holds for this module."""
    module = importlib.import_module("hpkit.plan.torch_check")
    tracked = module.check_with_torch(shape, cand.layout)
    gib = tracked.peak_bytes / 2**30
    # The tracker sees tensors only: the planner's fixed costs (CUDA context, NCCL) and the allocator's reserve
    # are left out.
    planner = cand.memory.worst.breakdown.allocated / 2**30 if cand.memory is not None else cand.peak_gib
    return {
        "layout": cand.layout.describe(),
        "torch_peak_gib": round(gib, 3),
        "planner_peak_gib_without_fixed": round(planner, 3),
        "planner_vs_torch": round(planner / gib - 1, 4) if gib else None,
        "torch_by_category_gib": {k: round(v / 2**30, 3) for k, v in tracked.by_category.items()},
    }


def _torch_line(check: dict[str, Any]) -> str:
    diff = check["planner_vs_torch"]
    return (
        f"torch's FSDPMemTracker on {check['layout']}: {check['torch_peak_gib']:.2f} GiB per GPU; the planner, "
        f"without its fixed costs: {check['planner_peak_gib_without_fixed']:.2f} GiB"
        + (f" ({diff:+.1%})" if diff is not None else "")
    )


def parse_args(argv: list[str], prog: str = "hpkit plan") -> argparse.Namespace:
    """The command line as `hpkit.cli.parse` and main read it (argv[0] is the command's name)."""
    return _parser(prog).parse_args(argv[1:])


def main(argv: list[str], prog: str = "hpkit plan") -> int:
    args = parse_args(argv, prog)
    args.command_line = shlex.join(["hpkit", "plan", *argv[1:]])
    if args.goodput:
        return plan_goodput.main(args)
    if not args.target:
        raise SpecError(
            "target: missing: name a model (8B, 70B, a config.json folder) or a job spec, or give --goodput"
        )
    target = Path(args.target)
    if target.suffix in (".yaml", ".yml", ".json") and not target.is_dir():
        from hpkit.validation import read_document

        document = read_document(target)
        if isinstance(document, dict) and set(document) == {"model"}:
            return _search(args, document["model"])  # a file of a model: block alone: a shape with overrides
        if args.trial:
            if args.spec_base:
                raise SpecError(f"--spec-base: {args.target} is a job spec already: its job fields are used")
            return _search(args, base=_load_spec(target))
        return _judge_spec(args, target)
    if args.spec_base and not args.trial:
        raise SpecError("--spec-base: only with --trial K (the job fields of the trial jobs)")
    return _search(args, base=_load_spec(Path(args.spec_base)) if args.spec_base else None)


def _load_spec(path: Path) -> Any:
    from hpkit.spec import JobSpec
    from hpkit.validation import load_document

    return load_document(JobSpec, path)


def _search(args: argparse.Namespace, model: Any = None, base: Any = None) -> int:
    """Rank the layouts for a model (a shape, a model: block, or, with --trial on a spec, the spec's own
    model, world and batch); `base` is the job spec whose job fields --trial's jobs take."""
    from hpkit.plan.problem import rank, resolve

    problem = resolve(_ask(args, model, base))
    if args.trial and args.trial_steps <= _trial_warmup():
        raise SpecError(
            f"--trial-steps {args.trial_steps}: give more than {_trial_warmup()} (the first are warm-up)"
        )
    result = rank(problem)
    check = _fsdp_torch_check(problem, result) if args.check_with_torch else None
    if args.write:
        _write(Path(args.write), args, problem, result)
    trials = _trials(args, problem, result, base) if args.trial else None
    if args.json:
        _print_search_json(args, problem, result, check, trials)
    else:
        _print_search_text(args, problem, result, check, trials)
    if trials is not None and not any(t.measured for t in trials):
        return 1  # no trial measured anything: the table says why
    return 0


def _ask(args: argparse.Namespace, model: Any, base: Any) -> Any:
    """The flags as the planner's question."""
    from hpkit.plan.problem import PlanAsk

    return PlanAsk(
        target=args.target,
        nodes=args.nodes,
        instance=args.instance,
        seq=args.seq,
        global_batch=args.global_batch,
        global_tokens=args.global_tokens,
        precision=args.precision,
        network=args.network,
        model=model,
        base=base,
        spec_mode=base is not None
        and not args.spec_base,  # --trial on a job spec: its model, world and batch
    )


def _fsdp_torch_check(problem: Any, result: Any) -> dict[str, Any]:
    """--check-with-torch on the best-ranked FSDP-only layout, the only kind torch's tracker follows."""
    fsdp_only = [c for c in result.ranked if c.layout.world == c.layout.dp_shard]
    if not fsdp_only:
        raise SpecError(
            "--check-with-torch: no FSDP-only layout fits, and torch's tracker follows only those (dp_shard)"
        )
    return _torch_check(problem.shape, fsdp_only[0])


def _print_search_json(
    args: argparse.Namespace,
    problem: Any,
    result: Any,
    check: dict[str, Any] | None,
    trials: list[Any] | None,
) -> None:
    from hpkit.plan import report

    meta = {
        "model": problem.target,
        "instance": problem.hw.name,
        "nodes": problem.nodes,
        "seq": problem.seq,
        "precision": problem.precision,
    }
    document = report.search_json(meta, result, args.top)
    if check is not None:
        document["torch_check"] = check
    if trials is not None:
        document["trials"] = [t.to_json() for t in trials]
    print(json.dumps(document, indent=2))


def _print_search_text(
    args: argparse.Namespace,
    problem: Any,
    result: Any,
    check: dict[str, Any] | None,
    trials: list[Any] | None,
) -> None:
    from hpkit.plan import report

    p = problem
    title = (
        f"{p.target} on {p.nodes} x {p.hw.name} ({p.world} GPUs, {p.gpu_gib:g} GiB each), seq {p.seq}, "
        f"global batch {p.global_batch} ({p.global_batch * p.seq:,} tokens), {p.precision}"
    )
    print(report.search_text(title, result, args.top))
    if args.explain:
        print(_explain(p.shape, result.ranked[0], p.hw, p.instance))
    if check is not None:
        print("\n" + _torch_line(check))
    if args.write:
        print(f"\nwrote {args.write}")
    if trials is not None:
        from hpkit.plan.trial import table

        print(f"\ntrials, re-ranked by measured tokens/s per GPU ({args.trial_steps} steps each):")
        print(table(trials))


def _trial_warmup() -> int:
    from hpkit.plan.trial import WARMUP_STEPS

    return WARMUP_STEPS


def _trials(args: argparse.Namespace, problem: Any, result: Any, base: Any) -> list[Any]:
    """--trial: the top K as short jobs under the base's job fields, submitted, waited for and measured."""
    from hpkit.plan import trial
    from hpkit.plan.recipe import model_block
    from hpkit.slurm import get_backend

    hw, seq = problem.hw, problem.seq
    model = model_block(args.target, seq) if problem.model is None else dict(problem.model, seq_len=seq)
    if base is None:
        print(
            "hpkit plan: note: --trial without --spec-base: the trial jobs take "
            + ", ".join(trial.DEFAULTED)
            + ": give --spec-base job.yaml to set them",
            file=sys.stderr,
        )
        dumped = None
        prefix = "plan-" + "".join(ch if ch.isalnum() else "-" for ch in Path(args.target).name.lower())
    else:
        dumped = base.document()
        prefix = base.job.name
        if not base.job.time_limit:
            print(
                f"hpkit plan: note: {args.spec_base or args.target} names no time_limit: the trial jobs "
                f"take {trial.DEFAULT_TIME_LIMIT}",
                file=sys.stderr,
            )
    job = trial.job_fields(dumped, hw)
    base_train = dumped["train"] if dumped else None
    trials = trial.choose(result, args.trial, prefix)
    specs = [trial.trial_spec(t, model, hw, problem.nodes, job, base_train, args.trial_steps) for t in trials]
    # Where the trials' specs go: beside their snapshots and logs, in the jobs' output_dir (as prepare puts it).
    workdir = Path(job["workdir"]) if job.get("workdir") else Path.cwd()
    folder = workdir.resolve() / job.get("output_dir", "logs")
    done = trial.run_trials(trials, specs, folder, get_backend(), problem.world, poll_s=args.poll)
    return trial.rerank(done)


def _judge_spec(args: argparse.Namespace, path: Path) -> int:
    from hpkit.plan import report
    from hpkit.plan.layout import Layout
    from hpkit.plan.problem import hardware
    from hpkit.plan.search import judge
    from hpkit.plan.shapes import shape_of_spec
    from hpkit.spec import JobSpec
    from hpkit.validation import load_document

    spec = load_document(JobSpec, path)
    job, run = spec.job, spec.run
    instance = args.instance or job.instance_type
    if not instance:
        raise SpecError(f"{path}: instance_type: missing: set it in the spec, or give --instance")
    shape = shape_of_spec(run.model)
    if args.seq:
        from dataclasses import replace

        shape = replace(shape, seq_len=args.seq)
    hw, gpu_gib = hardware(instance, "bf16", args.network)
    layout = Layout.from_run_config(run, world=job.world_size, device_type="cuda")
    if job.ranks_per_node != hw.gpus_per_node:
        from dataclasses import replace

        hw = replace(hw, gpus_per_node=job.ranks_per_node)
    if layout.precision != "bf16":
        hw, gpu_gib = hardware(instance, layout.precision, args.network)
    cand = judge(shape, layout, hw, instance, gpu_gib, memory_checkpoint=run.checkpoint.memory)
    check = _torch_check(shape, cand) if args.check_with_torch and cand.peak_gib is not None else None
    title = (
        f"{path}: {run.model.name} seq {shape.seq_len} on {job.nodes} x {hw.name} ({job.world_size} ranks)"
    )
    if args.json:
        meta = {"spec": str(path), "instance": hw.name, "nodes": job.nodes, "gpu_memory_gib": gpu_gib}
        if check is not None:
            meta["torch_check"] = check
        print(json.dumps({**meta, **cand.to_json()}, indent=2))
    else:
        print(report.judge_text(title, cand))
        if args.explain:
            print(_explain(shape, cand, hw, instance))
        if check is not None:
            print(_torch_line(check))
    return 0 if cand.fits else 1


def _explain(shape: Any, cand: Any, hw: Any, instance: str | None) -> str:
    from hpkit.plan.explain import explain_text

    return explain_text(shape, cand, hw, instance)


def _write(path: Path, args: argparse.Namespace, problem: Any, result: Any) -> None:
    """The winner as a job spec; the runners-up and why they lost as comments above it."""
    from hpkit.plan.recipe import model_block, spec_text

    model, seq = problem.model, problem.seq
    stem = Path(args.target).stem if model is not None else Path(args.target).name
    name = "plan-" + "".join(ch if ch.isalnum() else "-" for ch in stem.lower())
    block = dict(model, seq_len=seq) if model is not None else model_block(args.target, seq)
    command = (
        " ".join(["hpkit plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"] else f"hpkit plan {args.target}"
    )
    text = spec_text(name, block, problem.hw, problem.nodes, result, args.top, command)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise HpkitError(f"--write {path}: {exc.strerror or exc}") from None


if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
