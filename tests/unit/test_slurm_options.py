"""Slurm options in the spec: typed fields in Slurm's syntax, and the sbatch_options/srun_options escape hatch."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.slurm.options import (
    PYXIS_OPTIONS,
    SBATCH_OPTIONS,
    SBATCH_OPTIONS_SINCE_24_11,
    SRUN_OPTIONS,
    SRUN_OPTIONS_SINCE_24_11,
)
from hpkit.slurm.script import sbatch_directives, srun_options
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

MIN_CONF = "ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n"


def _help_options(command: str, tmp_path: Path) -> set[str]:
    if shutil.which(command) is None:
        pytest.skip(f"{command} is not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text(MIN_CONF)  # --help needs a configuration source, not a controller
    proc = subprocess.run(
        [command, "--help"], capture_output=True, text=True, env={"SLURM_CONF": str(conf)}, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", proc.stdout))


def _man_options(command: str) -> set[str] | None:
    page = Path(f"/usr/share/man/man1/{command}.1.gz")
    if not page.exists():
        return None
    text = gzip.decompress(page.read_bytes()).decode(errors="replace")
    # Each option's entry is a .TP paragraph whose first line names it: \fB\-\-name\fR
    heads = re.findall(r"^\.TP\n(.*)$", text, flags=re.MULTILINE)
    return {m.replace("\\-", "-") for h in heads for m in re.findall(r"\\fB\\-\\-((?:[a-z0-9]|\\-)+)", h)}


# The host's Slurm is 22.05: the options 24.11 added are checked against its help in test_slurm_options_24_11.py.
@pytest.mark.parametrize(
    ("command", "known"),
    [
        ("sbatch", SBATCH_OPTIONS - SBATCH_OPTIONS_SINCE_24_11),
        ("srun", SRUN_OPTIONS - SRUN_OPTIONS_SINCE_24_11),
    ],
)
def test_known_options_match_the_installed_slurm(tmp_path, command, known):
    """Every option `--help` prints is known; every known one is in `--help` or the man page."""
    helped = _help_options(command, tmp_path)
    assert len(helped) > 80, helped
    assert helped <= known, f"{command} --help lists options hpkit does not know: {sorted(helped - known)}"
    man = _man_options(command)
    if man is not None:
        assert known <= helped | man, f"not in {command}'s help or man page: {sorted(known - helped - man)}"


VALID = {
    "exclude": ("node[1-3,7],gpu-12", "#SBATCH --exclude=node[1-3,7],gpu-12"),
    "nodelist": (["p5-[001-004]", "p5-010"], "#SBATCH --nodelist=p5-[001-004],p5-010"),
    "constraint": ("[rack1*2&rack2*4]|(a100&efa)", "#SBATCH --constraint=[rack1*2&rack2*4]|(a100&efa)"),
    "mem": ("64g", "#SBATCH --mem=64G"),
    "gres": ("nvme:1,bandwidth:lustre:4", "#SBATCH --gres=nvme:1,bandwidth:lustre:4"),
    "reservation": ("maint,urgent", "#SBATCH --reservation=maint,urgent"),
    "dependency": ("afterok:12:13_4?after:9+5", "#SBATCH --dependency=afterok:12:13_4?after:9+5"),
    "mail_type": ("begin,TIME_LIMIT_80", "#SBATCH --mail-type=BEGIN,TIME_LIMIT_80"),
    "mail_user": ("ops@example.com", "#SBATCH --mail-user=ops@example.com"),
    "signal": ("R:SIGUSR2@90", "#SBATCH --signal=R:SIGUSR2@90"),
    "sbatch_options": (["--comment=a;$(b)", "--hold"], "#SBATCH --comment=a;$(b)\n#SBATCH --hold"),
}


@pytest.mark.parametrize("field", sorted(VALID))
def test_valid_options_become_sbatch_directives(field):
    value, line = VALID[field]
    script = render(parse_document(JobSpec, {"name": "x", field: value}))
    assert line in script
    if field == "signal":  # it replaces hpkit's own warning signal: only one --signal line
        assert script.count("#SBATCH --signal=") == 1
        assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90" in script


INVALID = [
    ("exclude", "node1 node2", "exclude: 'node1 node2' must be one token"),
    ("nodelist", "node[1-2", "nodelist: 'node[1-2' is not a Slurm host list"),
    ("nodelist", "node[3-1]", "nodelist: invalid host list 'node[3-1]': '3-1' is not a range"),
    ("exclude", "n[1-9999999]", "exclude: invalid host list 'n[1-9999999]': more than 65,536 hosts"),
    ("constraint", "a100 && efa", "constraint: 'a100 && efa' must be one token"),
    ("mem", "64GB", "mem: '64GB' is not a Slurm size"),
    ("mem", "-1", "mem: '-1' is not a Slurm size"),
    ("gres", "gpu:a100:two", "gres: 'gpu:a100:two' is not of the form"),
    ("reservation", "a#b", "reservation: a reservation name"),
    ("dependency", "afterok", "dependency: 'afterok' is not a Slurm dependency"),
    ("dependency", "afterok:1,afterany:2?afterok:3", "is not a Slurm dependency"),
    ("dependency", "after:abc", "is not a Slurm dependency"),
    ("mail_type", ["END", "SOMETIMES"], "mail_type: 'SOMETIMES' is not a Slurm mail type"),
    ("mail_user", "ops@x;rm", "mail_user: 'ops@x;rm' is not a user name or mail address"),
    ("signal", "USR1@99999", "signal: 'USR1@99999': the time before the end must be 0-65535"),
    ("signal", "C:USR1", "signal: 'C:USR1' is not of the form"),
    ("signal", "SIGNOPE", "signal: 'SIGNOPE': signal 'NOPE' is not"),
    ("signal", "B:TERM@60", "signal: 'B:TERM@60': hpkit's batch script handles only USR1"),
    (
        "sbatch_options",
        ["--job-name=y"],
        "sbatch_options: '--job-name=y': hpkit sets --job-name itself: use name",
    ),
    ("sbatch_options", ["--time=5"], "use time_limit in the spec instead"),
    ("sbatch_options", ["--mem=4G"], "use mem in the spec instead"),
    (
        "sbatch_options",
        ["--requeue"],
        "use resilience.max_restarts and resilience.requeue_on_failure in the spec instead",
    ),
    ("sbatch_options", ["--no-kill"], "use resilience.requeue_on_failure (Slurm requeues the job"),
    ("sbatch_options", ["--open-mode=truncate"], "hpkit appends so that a requeued job keeps"),
    (
        "sbatch_options",
        ["--wrap=id"],
        "'--wrap=id': --wrap is not accepted here: it replaces the rendered script",
    ),
    # hpkit runs arrays (sweeps) itself, each task with its own log, spec, metrics and checkpoints.
    (
        "sbatch_options",
        ["--array=0-3"],
        "--array is not accepted here: a sweep is hpkit's job array: `hpkit submit",
    ),
    ("sbatch_options", ["--part=p"], "--part is not an sbatch option hpkit knows"),
    ("sbatch_options", ["-p=p"], "give a long option, --name=value"),
    ("sbatch_options", ["--comment=two words"], "the value 'two words' must be one token"),
    ("sbatch_options", ["--comment=a#b"], "must be one token"),
    ("sbatch_options", ["--comment=x\n#SBATCH --uid=0"], "an entry must not contain newlines"),
    ("sbatch_options", ["--kill-on-bad-exit"], "--kill-on-bad-exit is not an sbatch option"),
    ("srun_options", ["--kill-on-bad-exit=0"], "hpkit sets --kill-on-bad-exit itself"),
    ("srun_options", ["--mpi=none"], "use launcher: mpi in the spec instead"),
    ("srun_options", ["--container-image=x"], "use container.image in the spec instead"),
    ("srun_options", ["--ntasks=1"], "use nodes and tasks_per_node in the spec instead"),
    ("srun_options", ["--label\n"], "an entry must not contain newlines"),
    ("srun_options", ["--export=A='b c'"], "must be one token"),
]


@pytest.mark.parametrize(("field", "value", "message"), INVALID, ids=[f"{f}-{v!r}" for f, v, _ in INVALID])
def test_invalid_options_are_one_line_naming_the_field(field, value, message):
    with pytest.raises(SpecError) as err:
        parse_document(JobSpec, {"name": "x", field: value})
    text = str(err.value)
    assert len(text.splitlines()) == 1 and text.startswith(f"spec: {field}: "), text
    assert message in text, text


def test_conflicts_between_fields_are_refused():
    with pytest.raises(SpecError, match=r"^spec: gres: GPUs come from gpus_per_node"):
        parse_document(JobSpec, {"name": "x", "gpus_per_node": 8, "gres": "gpu:h100:8"})
    with pytest.raises(
        SpecError, match=r"^spec: mem: Slurm's --mem, --mem-per-cpu and --mem-per-gpu exclude"
    ):
        parse_document(JobSpec, {"name": "x", "mem": "8G", "sbatch_options": ["--mem-per-gpu=8G"]})
    # gres without gpu, and gpu gres on a spec that counts no GPUs, are fine
    parse_document(JobSpec, {"name": "x", "gpus_per_node": 8, "gres": "nvme:1"})
    parse_document(JobSpec, {"name": "x", "gres": "gpu:1"})


def test_srun_options_are_quoted_after_hpkits_own():
    spec = parse_document(
        JobSpec, {"name": "x", "launcher": "mpi", "srun_options": ["--label", "--comment=$(id)"]}
    )
    assert srun_options(spec.job) == ["--kill-on-bad-exit=1", "--mpi=pmix", "--label", "'--comment=$(id)'"]
    assert "--container-env=A" in " ".join(
        srun_options(parse_document(JobSpec, {"name": "x", "srun_options": ["--container-env=A"]}).job)
    )
    assert all(o in PYXIS_OPTIONS for o in ("container-image", "container-env"))


def test_sbatch_options_come_after_the_typed_directives():
    spec = parse_document(
        JobSpec, {"name": "x", "exclude": "n1", "sbatch_options": ["--comment=c", "--hold"]}
    )
    lines = [d.line() for d in sbatch_directives(spec.job)]
    assert lines[-3:] == ["#SBATCH --exclude=n1", "#SBATCH --comment=c", "#SBATCH --hold"]


def test_a_time_limit_past_slurms_32_bit_minutes_is_not_a_slurm_time():
    # sbatch holds minutes in 32 bits (0xfffffffe and 0xffffffff mean unset and INFINITE): past it, sbatch refused a
    # script the dry run had written.
    from hpkit.slurm.options import MAX_TIME_MINUTES, is_slurm_time, time_minutes

    forms = {
        "30": 30,
        "30:01": 31,
        "1:00:00": 60,
        "1:00:30": 61,
        "2-3": 3060,
        "2-03:04": 3064,
        "2-03:04:05": 3065,
        "0": 0,
    }
    assert {value: time_minutes(value) for value in forms} == forms
    assert is_slurm_time(str(MAX_TIME_MINUTES)) and is_slurm_time("UNLIMITED") and is_slurm_time("INFINITE")
    assert not is_slurm_time(str(MAX_TIME_MINUTES + 1))
    assert not is_slurm_time("99999999999999999999") and not is_slurm_time("3000000-00:00:00")
