"""`hpkit check --all-nodes`: run the compute profile on every node through one Slurm job, then compare.

The job has one task per node. Its first step runs `python -m hpkit check --profile compute --json` on
each node, each task writing its own file; with --bandwidth a second step runs hpkit.netbench.pairs. The
files land in --output-dir, which must be on the filesystem the nodes share (as a job's output does).
This side only submits, waits and reads: hpkit.checks.fleet decides what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpkit import json_text, slurm
from hpkit.arg_types import byte_size
from hpkit.checks import fleet
from hpkit.errors import HpkitError, SlurmError, SpecError
from hpkit.netbench.pairs import DEFAULT_ROUNDS, DEFAULT_SIZE
from hpkit.slurm import hostlist
from hpkit.slurm.hostlist import compress, natural_key
from hpkit.slurm.job import SlurmJob

# Node states in which a node can run the check job (sinfo's short forms, without the *~#... suffix).
_USABLE = {"idle", "mix", "alloc", "comp", "resv", "plnd", "mixed", "allocated", "completing", "planned"}


@dataclass(frozen=True)
class Request:
    partition: str | None
    nodes: int | None
    nodelist: str | None
    check_args: tuple[str, ...]  # passed on to each node's `hpkit check`
    output_dir: Path
    time_limit: str
    wait_timeout_s: float
    python: str = sys.executable
    bandwidth: bool = False
    rounds: int = DEFAULT_ROUNDS
    size_bytes: int = byte_size(DEFAULT_SIZE)
    fraction: float = fleet.DEFAULT_BANDWIDTH_FRACTION


@dataclass(frozen=True)
class Gathered:
    job_id: str
    state: str
    report: fleet.FleetReport
    seconds: float
    files: Path
    # Down, drained or failed in Slurm's view: not checked, and not schedulable anyway.
    not_checked: dict[str, str] = field(default_factory=dict)


def node_count(req: Request) -> tuple[int, dict[str, str]]:
    """How many nodes the job asks for (--nodes, the --nodelist's length, else every node that is up),
    and the nodes left out because Slurm has them down, drained or failed (name -> state)."""
    if req.nodes is not None:
        return req.nodes, {}
    if req.nodelist:
        return len(hostlist.expand(req.nodelist)), {}
    states = slurm.node_states(req.partition)
    usable = [name for name, state in states.items() if state.rstrip("*~#!%$@^-+") in _USABLE]
    if not usable:
        where = f"partition {req.partition}" if req.partition else "the default partition"
        raise HpkitError(f"{where} has no node that is up: see `sinfo -N`, or name nodes with --nodelist")
    left_out = {name: state for name, state in states.items() if name not in usable}
    return len(usable), {name: left_out[name] for name in sorted(left_out, key=natural_key)}


# The job's fields and the flags they come from, for error messages.
_FLAGS = {
    "partition": "--partition",
    "nodelist": "--nodelist",
    "time_limit": "--time-limit",
    "output_dir": "--output-dir",
}


def slurm_job(req: Request, nodes: int = 1) -> SlurmJob:
    """The check job as a SlurmJob: validated as every job's fields are, errors naming the flags."""
    from hpkit.validation import parse_document

    data = {
        "name": "hpkit-check-nodes",
        "nodes": nodes,
        "tasks_per_node": 1,
        "launcher": "srun",
        "time_limit": req.time_limit,
        "output_dir": str(req.output_dir),
        "command": [req.python, "-m", "hpkit", "check"],
        **{key: value for key in ("partition", "nodelist") if (value := getattr(req, key)) is not None},
    }
    try:
        return parse_document(SlurmJob, data, source="options")
    except SpecError as exc:
        lines = []
        for line in str(exc).splitlines():
            field, _, why = line.removeprefix("options: ").partition(": ")
            flag, value = _FLAGS.get(field), repr(data.get(field))
            if flag is None:
                lines.append(line)
            else:  # "--time-limit 'ten' is not a Slurm time: ...", the value said once
                lines.append(f"{flag} {why}" if why.startswith(value) else f"{flag} {value}: {why}")
        raise HpkitError("\n".join(lines)) from None


def validate(req: Request) -> None:
    """Refuse, before asking Slurm anything, what the job's #SBATCH lines cannot carry."""
    slurm_job(req)


def render_script(req: Request, nodes: int) -> str:
    """The check job's script: hpkit.slurm.script's directives, then one srun step per check, each task into its own file."""
    from hpkit.slurm.script import sbatch_directives, template_environment

    job = slurm_job(req, nodes)
    out = req.output_dir
    step = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    check = [req.python, "-m", "hpkit", "check", "--profile", "compute", "--json", *req.check_args]
    steps = [[*step, f"--output={out}/check-%j-%t.json", f"--error={out}/check-%j-%t.err", *check]]
    if req.bandwidth:
        pairs = [
            req.python,
            "-m",
            "hpkit.netbench.pairs",
            "--rounds",
            str(req.rounds),
            "--size",
            str(req.size_bytes),
            "--confirm-below",
            str(req.fraction),
        ]
        steps.append([*step, f"--output={out}/pairs-%j.json", f"--error={out}/pairs-%j.err", *pairs])
    return (
        template_environment()
        .get_template("check-nodes.sbatch.j2")
        .render(directives=[d.line() for d in sbatch_directives(job)], steps=[shlex.join(s) for s in steps])
    )


def _job_nodes(nodes: str) -> list[str]:
    return hostlist.expand(nodes)


def gather(req: Request, job_id: str, nodes: list[str]) -> tuple[list[fleet.NodeReport], dict | None]:
    """Each task's report (task t ran on the job's t-th node: one task per node, in node order)."""
    reports = []
    for task, node in enumerate(nodes):
        path = req.output_dir / f"check-{job_id}-{task}.json"
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        report = fleet.parse_node_report(text, node)
        if report.error and not text:
            err = req.output_dir / f"check-{job_id}-{task}.err"
            tail = (err.read_text(errors="replace").strip().splitlines() or [""])[-1] if err.exists() else ""
            report = fleet.NodeReport(node, error=f"no report in {path}" + (f": {tail}" if tail else ""))
        reports.append(report)
    pairs = None
    if req.bandwidth:
        path = req.output_dir / f"pairs-{job_id}.json"
        try:
            pairs = json_text.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pairs = {"nodes": nodes, "rounds": [], "error": f"no bandwidth result in {path}"}
    return reports, pairs


def run(req: Request, backend=None) -> Gathered:
    from hpkit.netbench.pairs import best_per_node

    validate(req)
    backend = backend or slurm.get_backend()
    count, left_out = node_count(req)
    if req.bandwidth and count < 2:
        raise HpkitError("--bandwidth needs at least 2 nodes: pairs are measured against each other")
    req.output_dir.mkdir(parents=True, exist_ok=True)
    script = req.output_dir / "check-nodes.sbatch"
    script.write_text(render_script(req, count), encoding="utf-8")
    started = time.monotonic()
    job_id = backend.submit(script)
    print(
        f"hpkit check --all-nodes: job {job_id} on {count} node(s); files in {req.output_dir}",
        file=sys.stderr,
    )
    try:
        info = slurm.wait(backend, job_id, poll_s=1.0, timeout_s=req.wait_timeout_s)
    except BaseException as exc:  # also Ctrl-C: a check job nobody waits for should not hold the nodes
        with contextlib.suppress(SlurmError):
            backend.cancel(job_id)
        if isinstance(exc, SlurmError) and time.monotonic() - started > req.wait_timeout_s:
            raise SlurmError(
                f"job {job_id} did not finish within {req.wait_timeout_s:g} s (cancelled): are the nodes "
                "busy? raise --wait-timeout, or pick free nodes with --partition/--nodelist"
            ) from None
        raise
    nodes = _job_nodes(info.nodes)
    reports, pairs = gather(req, job_id, nodes)
    busbw = best_per_node(pairs) if pairs is not None else None
    report = fleet.analyse(reports, busbw, req.fraction)
    return Gathered(job_id, info.state.value, report, time.monotonic() - started, req.output_dir, left_out)


def _cell(nodes: tuple[str, ...]) -> str:
    return compress(nodes) if nodes else "-"


def print_report(g: Gathered, out=None) -> None:
    out = out or sys.stdout
    r = g.report
    write = out.write
    write(
        f"hpkit check --all-nodes: {len(r.nodes)} node(s) {compress(r.nodes)}, job {g.job_id} ({g.state}), "
        f"{g.seconds:.1f} s\n\n"
    )
    header = ("check", "passed", "warned", "failed", "skipped")
    table = [header] + [(row.name, *(_cell(row.nodes.get(s, ())) for s in fleet.STATUSES)) for row in r.rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        write("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() + "\n")
    if g.not_checked:
        shown = ", ".join(f"{node} ({state})" for node, state in g.not_checked.items())
        write(f"\nnot checked, Slurm has them out of service: {shown}\n")
    if r.no_result:
        write("\nno report from:\n")
        for node, why in r.no_result.items():
            write(f"  {node}: {why}\n")
    if r.facts:
        write("\nfacts that differ between nodes:\n")
        for f in r.facts:
            odd = "; ".join(f"{node}: {json.dumps(value)}" for node, value in f.differ.items())
            if f.split:
                write(
                    f"  {f.name}: no majority ({compress(f.majority_nodes)}: {json.dumps(f.majority)}; {odd})\n"
                )
            else:
                write(f"  {f.name}: {json.dumps(f.majority)} on {compress(f.majority_nodes)}, but {odd}\n")
    if r.cluster_wide:
        write("\nfailed on every node (the image or the cluster's setup, not one node; fix it first):\n")
        any_report = next(iter(x for x in r.reports.values() if x.error is None))
        for name in r.cluster_wide:
            write(f"  {name}: {any_report.details.get(name, '')}\n")
            if any_report.fixes.get(name):
                write(f"    fix: {any_report.fixes[name]}\n")
    if r.node_failures:
        write("\nfailed on some nodes:\n")
        for node, names in r.node_failures.items():
            for name in names:
                write(f"  {node} {name}: {r.reports[node].details.get(name, '')}\n")
    if r.bandwidth is not None:
        bw = r.bandwidth
        if bw.median_gbps is None:
            write(f"\npairwise bandwidth: no figures at all; see {g.files}/pairs-{g.job_id}.err\n")
        median = f"{bw.median_gbps:.3f} GB/s" if bw.median_gbps is not None else "n/a"
        write(
            f"\npairwise all_reduce busbw (each node's best pair; a node below the line measured again): "
            f"median {median}, flagged below {bw.fraction:g} x median\n"
        )
        for node, value in sorted(bw.busbw_gbps.items(), key=lambda kv: natural_key(kv[0])):
            shown = f"{value:.3f} GB/s" if value is not None else "not measured"
            ratio = (
                f" ({value / bw.median_gbps:.2f} x median)" if value is not None and bw.median_gbps else ""
            )
            mark = "  SLOW" if node in bw.slow else ""
            write(f"  {node:<12} {shown}{ratio}{mark}\n")
    write("\n")
    if r.exclude:
        write(f"exclude these nodes: {fleet.exclude_option(r.exclude)}\n")
    elif r.ok:
        write("every node passed and agrees with the others\n")
    else:
        write("no single node to exclude; fix the findings above\n")
