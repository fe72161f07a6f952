"""Render the nccl-tests sbatch script (slurm/templates/nccl-tests.sbatch.j2).

Resources, placement, container, srun options and environment are a SlurmJob, so they are validated
exactly as a training job's are and reach the script through hpkit.slurm.script's directives, srun options,
container block (slurm/templates/_container.sbatch.j2, shared with the training template), start-up
check and quoting; only the nccl-tests arguments are decided here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpkit import __version__
from hpkit.errors import SpecError
from hpkit.sizes import human
from hpkit.slurm.job import SlurmJob
from hpkit.slurm.script import (
    ContainerBlock,
    container_block,
    sbatch_directives,
    shell_quote,
    srun_options,
    startup_check_step,
    task_wrapper,
    template_environment,
)

TESTS = (
    "all_reduce_perf",
    "all_gather_perf",
    "reduce_scatter_perf",
    "broadcast_perf",
    "reduce_perf",
    "alltoall_perf",
    "sendrecv_perf",
)
DEFAULT_TESTS = ("all_reduce_perf", "all_gather_perf", "reduce_scatter_perf", "alltoall_perf")


@dataclass(frozen=True)
class NcclTestsArgs:
    tests: tuple[str, ...] = DEFAULT_TESTS
    min_bytes: int = 8
    max_bytes: int = 8 * 1024**3
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    check: bool = True
    bin_dir: str = "/opt/nccl-tests/build"

    def __post_init__(self) -> None:
        unknown = [t for t in self.tests if t not in TESTS]
        if unknown or not self.tests:
            raise SpecError(
                f"--tests: unknown nccl-tests binary {', '.join(unknown) or '(none)'}: choose from {', '.join(TESTS)}"
            )
        if self.min_bytes > self.max_bytes:
            raise SpecError(
                f"-b/-e: the smallest size {self.min_bytes} is above the largest {self.max_bytes}"
            )
        if self.factor < 2:
            raise SpecError(f"-f: the step factor must be at least 2, not {self.factor}")
        if self.iters < 1 or self.warmup < 0:
            raise SpecError("-n/-w: iterations must be at least 1 and warmup at least 0")
        if not self.bin_dir or "\x00" in self.bin_dir:
            raise SpecError("--bin-dir: give the directory holding all_reduce_perf etc.")

    def words(self) -> list[str]:
        """nccl-tests' own options, in its spelling (-b 8 -e 8G -f 2 -g 1 ...)."""
        return [
            "-b", human(self.min_bytes),
            "-e", human(self.max_bytes),
            "-f", str(self.factor),
            "-g", "1",
            "-n", str(self.iters),
            "-w", str(self.warmup),
            "-c", "1" if self.check else "0",
        ]  # fmt: skip


@dataclass(frozen=True)
class NcclTestsContext:
    version: str
    script_name: str
    directives: list[str]
    env: list[tuple[str, str]]
    bin_dir: str
    tests: str
    args: str
    srun_options: list[str]
    task_wrapper: str  # before each test's binary: the image's start-up check, once per node
    container: ContainerBlock | None
    nodes: int
    ranks_per_node: int


def build_context(spec: SlurmJob, args: NcclTestsArgs, script_name: str) -> NcclTestsContext:
    if spec.launcher != "srun":
        # nccl-tests ranks are MPI processes: one Slurm task per GPU, which is the srun launcher's layout.
        raise SpecError("launcher: nccl-tests runs one MPI rank per task: use launcher: srun")
    container = spec.container
    return NcclTestsContext(
        version=__version__,
        script_name=shell_quote(script_name),
        directives=[d.line() for d in sbatch_directives(spec)],
        env=[(key, shell_quote(value)) for key, value in sorted(spec.env.items())],
        bin_dir=shell_quote(args.bin_dir),
        tests=" ".join(shell_quote(t) for t in args.tests),
        args=" ".join(shell_quote(w) for w in args.words()),
        # The same srun options and container as a training job's: hpkit.slurm.script decides both.
        # No --label: only rank 0 prints, each line whole, and `hpkit bench nccl --parse` reads it as is.
        srun_options=srun_options(spec, label=False),
        task_wrapper="".join(
            f"{word} " for word in task_wrapper(list(filter(None, [startup_check_step(container)])))
        ),
        container=container_block(spec),
        nodes=spec.nodes,
        ranks_per_node=spec.ranks_per_node,
    )


def render_nccl_tests(spec: SlurmJob, args: NcclTestsArgs, script_name: str = "nccl-tests.sbatch") -> str:
    context = build_context(spec, args, script_name)
    return template_environment().get_template("nccl-tests.sbatch.j2").render(ctx=context)
