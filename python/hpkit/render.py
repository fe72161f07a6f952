"""The training job's sbatch script, from a JobSpec: the Slurm job's script (hpkit.slurm.script: directives, srun
options, launch words, the shared container block) with what training adds, the requeue directives and the plan
its supervisor follows (`python -m hpkit.supervise`), laid out by train.sbatch.j2.

It sits above hpkit.spec, which the Slurm package cannot import (the runtime below the spec asks Slurm's client).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from hpkit import __version__
from hpkit.job_events import hangs_dir
from hpkit.rendezvous import port_shell_expression
from hpkit.slurm.job import (
    SlurmJob,
    runs_hpkit_train,
)
from hpkit.slurm.script import (
    ArrayPlan,
    ContainerBlock,
    Directive,
    array_path_word,
    container_block,
    launch_words,
    line_label_env,
    quote_words,
    sagemaker_exports,
    sbatch_directives,
    shell_quote,
    srun_options,
    tasks_per_node,
    template_environment,
    threads_expression,
    user_command,
    warm_client_words,
    zygote_command,
)
from hpkit.spec import JobSpec, ResilienceSpec
from hpkit.supervise.plan import Plan
from hpkit.supervise.probe import LOST_NODE_STATES


def resilience_directives(job: SlurmJob, resilience: ResilienceSpec) -> list[Directive]:
    """For scripts that trap the warning signal and requeue themselves (the train template)."""
    return [
        # A requeued job writes to the same file: append, or the first run's log is lost.
        Directive("open-mode", "append"),
        # B: signals the batch shell, which forwards to the step and then decides about requeueing.
        # A spec's own `signal` replaces it (the requeue path then runs only for B:USR1).
        Directive("signal", job.signal or f"B:USR1@{resilience.signal_grace_s}"),
        # A requeueable batch job whose node fails (the batch host included) is requeued by slurmctld
        # itself, and the script's next run resumes. Without it Slurm ends such a job as NODE_FAIL; the
        # script can still requeue itself after USR1 (it turns the flag on just for that).
        Directive("requeue" if resilience.requeues_on_failure() else "no-requeue"),
    ] + (
        # A lost node must not end the allocation: the next step runs on the others and a spare.
        [Directive("no-kill", why="spare nodes: the job keeps its allocation when one of its nodes dies")]
        if resilience.spare_nodes
        else []
    )


def supervise_plan(spec: JobSpec) -> str:
    """The restart policy the job's supervisor (`python -m hpkit.supervise`) follows, as JSON."""
    job, resilience = spec.job, spec.run.resilience
    return Plan(
        max_restarts=resilience.max_restarts,
        requeue_on_failure=resilience.requeues_on_failure(),
        spare_nodes=resilience.spare_nodes,
        nodes=job.nodes,
        step_tasks=job.nodes * tasks_per_node(job),
        tasks_per_node=tasks_per_node(job),
        replace_bad_nodes=resilience.replace_bad_nodes,
        launcher=job.launcher,
        output_dir=str(PurePosixPath(job.output_dir)),
        # Where hpkit train's watchdog writes (hpkit.runtime.run_identity.run_paths), from the job's directory.
        hangs_dir=str(hangs_dir(PurePosixPath(job.output_dir))),
        lost_node_states=LOST_NODE_STATES,
        # The batch host serves the watchdog's store under srun and mpi (hpkit-torchrun serves it under torchrun):
        # only for hpkit train with its watchdog on, since serving it imports torch (memory in the batch step).
        watch_store=job.launcher in ("srun", "mpi") and resilience.hang.enabled and runs_hpkit_train(job),
        ranks_ready=runs_hpkit_train(job),
        usr1_hold_s=resilience.signal_grace_s / 2,
        warm=zygote_command(job, spec.warm_starts, spec.run.resilience.warm_preload),
        sagemaker_hosts=job.sagemaker_env is not None,
        keep_survivors=spec.keeps_survivors,
        ranks=job.world_size,
    ).to_json()


@dataclass(frozen=True)
class RenderContext:
    """Everything the template needs, already decided and quoted."""

    version: str
    script_name: str
    spec_path: str | None
    directives: list[str]
    env: list[tuple[str, str]]
    launcher: str
    srun_options: list[str]
    sagemaker: bool
    sagemaker_env: list[tuple[str, str]]
    container: ContainerBlock | None
    threads: str
    master_port: str
    signal_grace_s: int
    max_restarts: int
    world_size: int
    ranks_per_node: int
    nodes: int
    spare_nodes: int
    supervise_plan: str  # shell-quoted JSON (hpkit.supervise.plan.Plan)
    sweep_overrides: list[
        str
    ]  # a job array's tasks' overrides, shell-quoted JSON by task number; [] otherwise
    sweep_manifest: str | None
    step: str  # shell-quoted: the launch words and the command, the shell text srun runs after its options


def build_context(
    spec: JobSpec,
    script_name: str = "job.sbatch",
    spec_path: str | None = None,
    array: ArrayPlan | None = None,
) -> RenderContext:
    job, resilience = spec.job, spec.run.resilience
    if array is not None:
        spec_word: str | None = array_path_word(array.spec_pattern)
    else:
        spec_word = shell_quote(spec_path) if spec_path else None
    warm = warm_client_words(job, spec.warm_starts)
    return RenderContext(
        version=__version__,
        script_name=shell_quote(script_name),
        spec_path=spec_word,
        directives=[
            d.line()
            for d in (
                *sbatch_directives(job, resilience.spare_nodes, array),
                *resilience_directives(job, resilience),
            )
        ],
        env=[(key, shell_quote(value)) for key, value in sorted(job.env.items())] + line_label_env(job),
        launcher=job.launcher,
        srun_options=srun_options(job),
        sagemaker=job.sagemaker_env is not None,
        sagemaker_env=sagemaker_exports(job),
        container=container_block(job),
        threads=threads_expression(job),
        master_port=port_shell_expression(),
        signal_grace_s=spec.signal_grace_s,
        max_restarts=resilience.max_restarts,
        world_size=job.world_size,
        ranks_per_node=job.ranks_per_node,
        nodes=job.nodes,
        spare_nodes=resilience.spare_nodes,
        supervise_plan=shell_quote(supervise_plan(spec)),
        sweep_overrides=[shell_quote(o) for o in array.overrides] if array else [],
        sweep_manifest=shell_quote(array.manifest) if array else None,
        step=shell_quote(
            " ".join(
                [
                    *launch_words(job, warm),
                    quote_words([*warm, *user_command(job)]),
                ]
            )
        ),
    )


def render(
    spec: JobSpec,
    script_name: str = "job.sbatch",
    spec_path: str | None = None,
    array: ArrayPlan | None = None,
) -> str:
    """Render the sbatch script for `spec`. `spec_path` is exported as HPKIT_SPEC for `hpkit train`; for a job
    array (`array`), each task's own spec snapshot is."""
    context = build_context(spec, script_name=script_name, spec_path=spec_path, array=array)
    return template_environment().get_template("train.sbatch.j2").render(ctx=context)
