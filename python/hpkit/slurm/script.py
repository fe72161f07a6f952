"""The sbatch script of a Slurm job of any kind, from a SlurmJob: its directives, srun's options, the launch words,
the container block every template shares (`_container.sbatch.j2`), quoting, and the Jinja2 environment over
slurm/templates. The training job's script (its supervisor plan and requeue directives, from a JobSpec) is
hpkit.render's; nccl-tests (hpkit.netbench.nccl_job) and the all-nodes check (hpkit.commands.check_nodes) render
with these pieces directly.

All decisions (which directives, which launcher arguments, which mounts) are made here in Python; the templates
only lay them out. Every value that reaches the shell passes through `shell_quote`, so a spec can carry any
characters without them being executed.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import jinja2

from hpkit.catalog import lookup
from hpkit.oci import IMAGE_PATH_VAR
from hpkit.slurm.job import (
    HYPERPOD_LOG_DIR,
    OCI_TASKS_SINCE_TEXT,
    TASK_PYTHON,
    VAR_LOG_MOUNT,
    ContainerSpec,
    SlurmJob,
    as_python_program,
    is_python,
    python_program_start,
    runs_hpkit_train,
)


def _template_dir() -> Path:
    """slurm/templates of the checkout this module runs from, else the copy an installed wheel carries.

    The checkout wins so that code run from one checkout (PYTHONPATH=python) never renders with the
    templates of another hpkit installed in the same environment.
    """
    checkout = Path(__file__).resolve().parents[3] / "slurm" / "templates"
    if (checkout / "train.sbatch.j2").is_file():
        return checkout
    return Path(str(importlib.resources.files("hpkit") / "templates"))


TEMPLATE_DIR = _template_dir()


def shell_quote(value: object) -> str:
    """Quote one word for bash: the only way a spec value reaches the shell."""
    text = str(value)
    if "," in text and shlex.quote(text) == text:
        # Bash reads a bare comma literally, but inside an array shellcheck takes it for a separator (SC2054).
        return f"'{text}'"
    return shlex.quote(text)


def quote_words(words: list[str]) -> str:
    return " ".join(shell_quote(w) for w in words)


@dataclass(frozen=True)
class Directive:
    option: str
    value: str | None = None
    why: str | None = None  # a comment line above the directive

    def line(self) -> str:
        line = f"#SBATCH --{self.option}" if self.value is None else f"#SBATCH --{self.option}={self.value}"
        return f"# {self.why}\n{line}" if self.why else line


def whole_node_cpus(spec: SlurmJob) -> int | None:
    """vCPUs per rank when the job takes every GPU of its instance type (spec `whole_node`), else None."""
    row = lookup(spec.instance_type)
    if not spec.whole_node or row is None or not row.gpus or spec.gpus_per_node != row.gpus or not row.vcpus:
        return None
    return max(row.vcpus // spec.ranks_per_node, 1)


def tasks_per_node(spec: SlurmJob) -> int:
    """Slurm tasks per node: torchrun starts one agent per node that forks the ranks; srun starts every rank."""
    return 1 if spec.launcher == "torchrun" else spec.ranks_per_node


# Where a task of a job array finds its number, in the rendered script; `%a` stands for it in ArrayPlan's paths
# (as in sbatch's --output).
ARRAY_TASK_SHELL = '"$SLURM_ARRAY_TASK_ID"'


@dataclass(frozen=True)
class ArrayPlan:
    """A job array (hpkit submit --sweep): one script, `tasks` tasks, each with its own spec snapshot."""

    tasks: int
    max_parallel: int | None  # None: all at once
    spec_pattern: str  # each task's spec snapshot, `%a` for its number (HPKIT_SPEC)
    overrides: list[str]  # each task's overrides as JSON (HPKIT_SWEEP_OVERRIDES), by task number
    manifest: str  # the sweep's file: every task's overrides (HPKIT_SWEEP; `hpkit status|why` read it)

    def directive(self) -> Directive:
        limit = f"%{self.max_parallel}" if self.max_parallel and self.max_parallel < self.tasks else ""
        return Directive("array", f"0-{self.tasks - 1}{limit}")


def array_path_word(pattern: str) -> str:
    """A path with `%a` as one shell word whose `%a` is the task's number."""
    return ARRAY_TASK_SHELL.join(shell_quote(part) for part in pattern.split("%a"))


def sbatch_directives(
    spec: SlurmJob, spare_nodes: int = 0, array: ArrayPlan | None = None
) -> list[Directive]:
    """`spare_nodes`: nodes allocated beyond the ones a step runs on (resilience.spare_nodes); `array`: a job
    array's tasks (each task's log is its own: %A_%a, the array's id and the task's number)."""
    out = Path(spec.output_dir)
    whole = whole_node_cpus(spec) if spec.cpus_per_task is None else None
    cpus_per_rank = spec.cpus_per_task or whole
    directives = [
        Directive("job-name", spec.name),
        Directive(
            "nodes",
            str(spec.nodes + spare_nodes),
            why=f"{spec.nodes} node(s) for the step and {spare_nodes} spare (resilience.spare_nodes)"
            if spare_nodes
            else None,
        ),
        Directive("ntasks-per-node", str(tasks_per_node(spec))),
        Directive("output", str(out / ("%x-%A_%a.out" if array else "%x-%j.out"))),
    ]
    if array is not None:
        directives.append(array.directive())
    if spec.launcher == "torchrun":
        directives.append(Directive("cpus-per-task", str((cpus_per_rank or 1) * spec.ranks_per_node)))
    elif cpus_per_rank:
        directives.append(Directive("cpus-per-task", str(cpus_per_rank)))
    if spec.gpus_per_node:
        directives.append(Directive("gpus-per-node", str(spec.gpus_per_node)))
    for option, value in (
        ("partition", spec.partition),
        ("account", spec.account),
        ("qos", spec.qos),
        ("time", spec.time_limit),
        ("chdir", spec.workdir),
        ("exclude", spec.exclude),
        ("nodelist", spec.nodelist),
        ("constraint", spec.constraint),
        ("mem", spec.mem),
        ("gres", spec.gres),
        ("reservation", spec.reservation),
        ("dependency", spec.dependency),
        ("mail-type", ",".join(spec.mail_type) or None),
        ("mail-user", spec.mail_user),
    ):
        if value is not None:
            directives.append(Directive(option, value))
    if whole is not None:
        directives.append(Directive("exclusive", why=_whole_node_note(spec, whole)))
    elif spec.exclusive:
        directives.append(Directive("exclusive"))
    # The escape hatch last, as written: spec.py checked each is a known option and one token.
    directives += [Directive(*entry[2:].split("=", 1)) for entry in spec.sbatch_options]
    return directives


def _whole_node_note(spec: SlurmJob, cpus_per_rank: int) -> str:
    """Why the job takes the whole node, for a comment above `--exclusive`."""
    row = lookup(spec.instance_type)
    assert row is not None
    return (
        f"whole node: the job uses all {row.gpus} GPUs of a {spec.instance_type}, so it takes the node and "
        f"its {row.vcpus} vCPUs, {cpus_per_rank} per rank (whole_node: false to share it)"
    )


def task_exports(spec: SlurmJob) -> list[str]:
    """Variables each task sets from its own Slurm variables (they differ per task, so not in the batch shell)."""
    exports = []
    if spec.launcher in ("srun", "mpi"):
        # One task per rank: torch.distributed reads these names, Slurm sets their sources per task.
        exports += ["RANK=$SLURM_PROCID", "LOCAL_RANK=$SLURM_LOCALID", "WORLD_SIZE=$SLURM_NTASKS"]
    if spec.sagemaker_env is not None:
        exports += ["SM_CURRENT_HOST=$SLURMD_NODENAME", "SM_NUM_CPUS=${SLURM_CPUS_ON_NODE:-1}"]
    return exports


def warm_client_words(job: SlurmJob, warm: bool) -> list[str]:
    """What starts each rank, and each node's torchrun agent, when they start warm (JobSpec.warm_starts):
    hpkit.warm.client, which has the node's zygote fork it (and runs it cold where none answers), before the
    command; nothing otherwise."""
    if not warm:
        return []
    return [user_command(job)[0], "-m", "hpkit.warm.client", "--"]


def zygote_command(job: SlurmJob, warm: bool, more: tuple[str, ...] = ()) -> str:
    """The command of the supervisor's background step that keeps a zygote (hpkit.warm.zygote) on every node of
    the allocation, spares included, as shell text; "" when ranks start cold. It preloads what the
    rank's command imports first: torch, for hpkit train hpkit's runtime, then `more` (resilience.warm_preload)."""
    if not warm:
        return ""
    # Under torchrun its agent is forked too (hpkit.torchrun_agent, launch_words): its imports first.
    agent = ["torch.distributed.run", "hpkit.torchrun_agent"] if job.launcher == "torchrun" else []
    # torch._dynamo: torch imports it at the first call of anything it wraps with _disable_dynamo (a model built on
    # the meta device, FSDP, DCP, the optimizers), 0.5-0.8 CPU-s in every rank after the fork where not preloaded.
    preload = ["torch", "torch._dynamo", *agent, "hpkit.run_script"]
    if runs_hpkit_train(job):
        preload += ["hpkit.cli", "hpkit.commands.train", "hpkit.runtime.run"]
    more = tuple(name for name in dict.fromkeys(more) if name not in preload)
    # The compat shim goes first on the ranks' PYTHONPATH (compat_step), which an interpreter reads as it starts: the
    # zygote starts with it too, or it would refuse every rank (hpkit.warm.protocol.STARTUP_VARS).
    # In an OCI container the zygote's python3 is the image's, as the ranks' (launch_words).
    wrapper = task_wrapper([step for step in (oci_path_step(job.container), compat_step(job)) if step])
    return " ".join(
        [
            *wrapper,
            *(
                shell_quote(word)
                for word in (
                    user_command(job)[0],
                    "-m",
                    "hpkit.warm.zygote",
                    f"--preload={','.join(preload)}",
                    *([f"--preload-more={','.join(more)}"] if more else []),
                )
            ),
        ]
    )


def compat_python(spec: SlurmJob) -> str:
    """The interpreter that tells a task where hpkit's shim folder is.

    Asked in the task, not at render time: in a pyxis container hpkit may live at another path than on
    the login node. The command's own interpreter when it is one (it is the Python that will import
    `smdistributed`), else `python3` from the task's PATH.
    """
    program = spec.command[0]
    return program if is_python(program) else TASK_PYTHON


SMP_V2_PRELOAD = "hpkit.compat.smp_v2:install"


def compat_step(spec: SlurmJob) -> str | None:
    """Shell that puts the shim first on the task's PYTHONPATH (spec `compat`), or None."""
    if not spec.compat:
        return None
    python = shell_quote(compat_python(spec))
    fix = (
        f"hpkit: compat: {compat_python(spec)} cannot import hpkit where the task runs: install hpkit "
        "there (in the container image too), or drop compat from the spec"
    )
    step = (
        f"shim=$({python} -m hpkit.compat 2>/dev/null) || {{ echo {shell_quote(fix)} >&2; exit 1; }}; "
        'export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"'
    )
    if "smp_v2" in spec.compat:
        # torch.sagemaker is a submodule of torch, which no PYTHONPATH entry can add to: hpkit.run_script
        # installs the layer before the script runs. tsm.init() without a config reads the spec's parameters.
        step += f"; export HPKIT_PRELOAD={SMP_V2_PRELOAD}"
        if spec.smp_parameters:
            config = json.dumps(spec.smp_parameters, sort_keys=True, separators=(",", ":"))
            step += f"; export HPKIT_SMP_V2_CONFIG={shell_quote(config)}"
    return step


def user_command(spec: SlurmJob) -> list[str]:
    """The spec's command as each rank runs it: a Python program goes through `hpkit.run_script`.

    The wrapper installs the exit hook that keeps an unchanged DDP script on gloo from aborting at exit
    (hpkit.exit_settle), so users' scripts need no change. Only where hpkit is importable by the task's
    Python: outside a container (the submitting environment's Python), or in one with `compat` (which
    needs hpkit in the image anyway). `python -c ...` and non-Python programs run as written.
    """
    if spec.container is not None and not spec.compat:
        return list(spec.command)
    command = as_python_program(spec.command)
    i = python_program_start(command)
    if i is None:
        return command  # not a Python program (or python -c, an interactive interpreter): nothing to wrap
    return [*command[:i], "-m", "hpkit.run_script", *command[i:]]


def startup_check_step(container: ContainerSpec | None) -> str | None:
    """Shell that runs the image's start-up check in the first task of each node, or None.

    pyxis does not run an image's entry point, so hpkit's images would skip their start-up check (IMDSv2,
    the host's /var/log): the first task of each node runs it, where the image has it.
    """
    if container is None or container.startup_check == "off":
        return None
    warn_only = "export HPKIT_STARTUP_CHECK_WARN_ONLY=1; " if container.startup_check == "warn" else ""
    return (
        f"{in_image_step(container)}; "
        'if [ "${SLURM_LOCALID:-0}" = 0 ] && command -v hpkit-entrypoint >/dev/null; then '
        f'{warn_only}set -- hpkit-entrypoint "$@"; fi'
    )


def in_image_step(container: ContainerSpec) -> str:
    """Shell that stops a task (or warns, under startup_check: warn) that runs on the host instead of its image.

    On HyperPod's configless Slurm, srun has been seen to ignore --container-image silently (pyxis not loaded on
    the node), and Slurm 22.05 without oci.conf ignores --container alike (measured): the job then runs on the
    host. The batch script (on the host) exports its root's device:inode as HPKIT_HOST_ROOT; a task that sees the
    same root is not in its image. One line per node (its first task), in the job's log.
    """
    where = shell_quote(f"container.image {container.image}")
    if container.runtime == "oci":
        fix = "srun ignored --container: put oci.conf beside slurm.conf on every node, then restart slurmd"
    else:
        fix = (
            "srun ignored the container image: srun --help on that node must list the pyxis options "
            "(plugstack.conf loads spank_pyxis.so; on configless Slurm, on every node), then restart slurmd"
        )
    if container.startup_check == "warn":
        say, then = "hpkit: warning: ${SLURMD_NODENAME:-$(hostname)}: this task runs on the host, not in ", ""
        fix += "; going on (container.startup_check: warn)"
    else:
        # The pause lets the line reach the job's log before srun --kill-on-bad-exit ends the other tasks (as in
        # docker/entrypoint.sh).
        say, then = (
            "hpkit: ${SLURMD_NODENAME:-$(hostname)}: this task runs on the host, not in ",
            "; sleep 1; exit 1",
        )
    return (
        'if [ -n "${HPKIT_HOST_ROOT:-}" ] && [ "$(stat -Lc %d:%i / 2>/dev/null)" = "$HPKIT_HOST_ROOT" ]; then '
        f'[ "${{SLURM_LOCALID:-0}}" != 0 ] || echo "{say}"{where}": {fix}" >&2{then}; fi'
    )


def oci_path_step(container: ContainerSpec | None) -> str | None:
    """Shell that gives a task in a Slurm OCI container the image's PATH (runtime oci), or None.

    Slurm 22.05 puts the step's environment over the image's, so the host's PATH would hide the image's
    programs: the job's bundle carries the image's PATH as HPKIT_IMAGE_PATH (hpkit.oci.job_config). A host
    TMPDIR that is not mounted in the container is dropped (/tmp is the container's own).
    """
    if container is None or container.runtime != "oci":
        return None
    return f'export PATH="${{{IMAGE_PATH_VAR}:-$PATH}}"; [ -d "${{TMPDIR:-/tmp}}" ] || unset TMPDIR'


def torchrun_program(spec: SlurmJob) -> str:
    """hpkit's torchrun (its rendezvous store outlives every agent: hpkit.torchrun_agent) where hpkit is
    installed, i.e. outside a container; in one, torchrun, which torchrun_launcher_step swaps where it can."""
    return "hpkit-torchrun" if spec.container is None else "torchrun"


def torchrun_launcher_step(spec: SlurmJob) -> str | None:
    """Shell that runs hpkit-torchrun instead of torchrun in a container image that has it, or None.

    Not under runtime oci: Slurm 22.05 hands its containers the batch shell's SLURMD_NODENAME, so every
    node would take itself for the store's node.
    """
    if spec.launcher != "torchrun" or spec.container is None or spec.container.runtime == "oci":
        return None
    return 'if command -v hpkit-torchrun >/dev/null; then set -- hpkit-torchrun "${@:2}"; fi'


def task_wrapper(steps: list[str]) -> list[str]:
    """`bash -c 'STEPS; exec "$@"' hpkit-task` before a task's program (quoted words), or nothing."""
    return ["bash", "-c", shell_quote("; ".join([*steps, 'exec "$@"'])), "hpkit-task"] if steps else []


def launch_words(spec: SlurmJob, warm: list[str] | None = None) -> list[str]:
    """The program each srun task runs, before the user's command (already shell-quoted words). `warm`: the warm
    client's words (warm_client_words), which start torchrun's agent too, as `python -m hpkit.torchrun_agent`."""
    steps = []
    if image_path := oci_path_step(spec.container):
        steps.append(image_path)
    if exports := task_exports(spec):
        steps.append(f"export {' '.join(exports)}")
    if compat := compat_step(spec):
        steps.append(compat)
    if launcher_swap := torchrun_launcher_step(spec):
        steps.append(launcher_swap)
    if startup := startup_check_step(spec.container):
        steps.append(startup)
    wrapper = task_wrapper(steps)
    if spec.launcher == "torchrun":
        return [
            *wrapper,
            *(
                [*(shell_quote(w) for w in warm), shell_quote(warm[0]), "-m", "hpkit.torchrun_agent"]
                if warm
                else [torchrun_program(spec)]
            ),
            # The agents pass USR1 on to the ranks instead of dying of it.
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            f"--nnodes={spec.nodes}",
            f"--nproc-per-node={spec.ranks_per_node}",
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            '--rdzv-id="$SLURM_JOB_ID"',
            "--no-python",
            "--",
        ]
    return wrapper


def line_label_env(spec: SlurmJob) -> list[tuple[str, str]]:
    """torchrun's ranks share their node's output pipe: hpkit.run_script keeps their lines whole and labelled."""
    if spec.launcher == "torchrun" and user_command(spec) != list(spec.command):
        return [("HPKIT_LINE_LABEL", "1")]
    return []


def srun_options(spec: SlurmJob, label: bool = True) -> list[str]:
    """Options of the step's srun, before the container's. `label`: prefix each task's lines with its rank."""
    options = ["--kill-on-bad-exit=1"]
    if label and spec.launcher in ("srun", "mpi") and not {"--label", "-l"} & set(spec.srun_options):
        # One task per rank: srun writes each task's lines whole, prefixed with its rank.
        options.append("--label")
    if spec.launcher == "mpi":
        # Open MPI (and mpi4py on it) wires up through Slurm's PMIx server: no mpirun, no hostfile.
        options.append("--mpi=pmix")
    # The spec's own srun options, quoted like every other spec value that reaches the shell.
    options += [shell_quote(entry) for entry in spec.srun_options]
    return options


def _job_path(path: str) -> str:
    """A path for the job's environment, absolute as SageMaker's are: relative ones start at the job's cwd."""
    return shell_quote(path) if PurePosixPath(path).is_absolute() else f'"$PWD"/{shell_quote(path)}'


def sagemaker_exports(spec: SlurmJob) -> list[tuple[str, str]]:
    """SM_* variables that are the same for every task (name, shell word)."""
    sm = spec.sagemaker_env
    if sm is None:
        return []
    out = Path(spec.output_dir)
    exports = [
        ("SM_NUM_GPUS", str(spec.gpus_per_node)),
        ("SM_MODEL_DIR", _job_path(sm.model_dir or str(out / "model"))),
        ("SM_OUTPUT_DATA_DIR", _job_path(sm.output_data_dir or str(out / "output"))),
        ("SM_CHANNELS", shell_quote(json.dumps(sorted(sm.channels)))),
    ]
    exports += [(f"SM_CHANNEL_{name.upper()}", _job_path(path)) for name, path in sorted(sm.channels.items())]
    return exports


def container_mounts(container: ContainerSpec) -> list[str]:
    mounts = list(container.mounts)
    if container.mount_var_log and not any(m.split(":")[1] == "/var/log" for m in mounts):
        mounts.insert(0, VAR_LOG_MOUNT)
    return mounts


def oci_bundle_words(spec: SlurmJob) -> list[str]:
    """`python3 -m hpkit.oci bundle ...` without --out: the job's bundle from the exported image (runtime oci)."""
    container = spec.container
    if container is None or container.runtime != "oci":
        return []
    words = [TASK_PYTHON, "-m", "hpkit.oci", "bundle", "--image", shell_quote(container.image)]
    if container.mount_var_log:
        words.append("--var-log")
    for mount in container.mounts:
        words += ["--mount", shell_quote(mount)]
    if container.workdir:
        words += ["--workdir", shell_quote(container.workdir)]
    # The node's ranks and torchrun's agent: the container's CPU weight (hpkit.oci.job_config).
    words += ["--processes", str(spec.ranks_per_node + 1)]
    return words


def runtime_notes(spec: SlurmJob, warm: bool = False) -> list[str]:
    """One line for each thing the spec asks that its container runtime cannot do (printed at render time).
    `warm`: the ranks fork warm (JobSpec.warm_starts), which `hpkit submit` checks against the cluster's Slurm
    (hpkit.slurm.job.oci_warm_problem) and a script rendered and submitted by hand does not."""
    container = spec.container
    if container is None or container.runtime != "oci":
        return []
    notes = []
    if warm:
        notes.append(
            f"container.runtime oci: warm starts need Slurm {OCI_TASKS_SINCE_TEXT} or later (earlier, every container gets task "
            "0's SLURMD_NODENAME and no node's zygote can be found); hpkit submit checks the cluster's version"
        )
    if spec.sagemaker_env is not None:
        notes.append(
            "container.runtime oci: Slurm 22.05 passes no SLURMD_NODENAME into the container, so SM_CURRENT_HOST "
            "is empty there"
        )
    if spec.gpus_per_node:
        notes.append(
            "container.runtime oci: the job's bundle binds the host's /dev, but no NVIDIA hook adds the driver's "
            "libraries: the image must carry the ones matching the nodes' driver"
        )
    return notes


def threads_expression(spec: SlurmJob) -> str:
    """Shell arithmetic for OMP_NUM_THREADS: the node's CPUs shared among its ranks.

    srun does not set it, and torchrun's default of 1 starves CPU-side work.
    """
    if spec.launcher == "torchrun":
        per_rank = f"SLURM_CPUS_ON_NODE / {spec.ranks_per_node}"
        return f"$(( {per_rank} > 0 ? {per_rank} : 1 ))"
    return "${SLURM_CPUS_PER_TASK:-1}"


@dataclass(frozen=True)
class ContainerBlock:
    """What _container.sbatch.j2 reads, decided and quoted once for every job kind (training, nccl-tests)."""

    image: str
    mounts: str  # the spec's, /var/log first unless mount_var_log is off
    workdir: str | None
    hyperpod_log_mount: str | None  # HyperPod's log folder, mounted where the node has it
    runtime: str  # pyxis | oci
    oci_bundle: str | None  # runtime oci: the command that makes the job's bundle (--out follows)
    oci_bundle_dir: str


def container_block(job: SlurmJob) -> ContainerBlock | None:
    """The job's container block; None where the job runs on the host."""
    container = job.container
    if container is None:
        return None
    return ContainerBlock(
        image=shell_quote(container.image),
        mounts=shell_quote(",".join(container_mounts(container))),
        workdir=shell_quote(container.workdir) if container.workdir else None,
        hyperpod_log_mount=shell_quote(f"{HYPERPOD_LOG_DIR}:{HYPERPOD_LOG_DIR}")
        if container.mount_var_log
        else None,
        runtime=container.runtime,
        oci_bundle=" ".join(oci_bundle_words(job)) or None,
        oci_bundle_dir=_job_path(str(PurePosixPath(job.output_dir) / "oci-bundles")),
    )


@functools.cache
def template_environment() -> jinja2.Environment:
    """Strict (a missing value is an error) and unescaped: quoting is done before values reach it.

    One per process: compiling the template was half of a render (jinja2 still reloads a template
    whose file changed)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
