"""hpkit.slurm.client is the one module that runs Slurm's commands, and reads what they print the one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpkit.errors import SlurmError
from hpkit.slurm import client

PACKAGE = Path(client.__file__).resolve().parents[1]
CLIENT = Path(client.__file__).resolve()
# Ways to start a program from a string (a shell line): `subprocess.run("scontrol show ...", shell=True)`.
_SHELL_CALLS = {
    "run",
    "Popen",
    "call",
    "check_call",
    "check_output",
    "getoutput",
    "getstatusoutput",
    "system",
    "popen",
}


def _names_a_command(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in client.COMMANDS


def _shell_line(node: ast.expr) -> bool:
    text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        text = str(node.values[0].value)
    return text is not None and text.split(" ", 1)[0] in client.COMMANDS and " " in text


def stray_calls(source: str) -> list[int]:
    """Lines that name a Slurm command as a program: an argv (a list or tuple that starts with it), a call given
    its name (shutil.which("sinfo")), or a shell line handed to subprocess/os."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple) and node.elts and _names_a_command(node.elts[0]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            args = [*node.args, *(k.value for k in node.keywords)]
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if any(_names_a_command(a) for a in args) or (
                name in _SHELL_CALLS and any(_shell_line(a) for a in args)
            ):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_no_module_but_the_client_runs_a_slurm_command():
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}": path.read_text().splitlines()[line - 1].strip()
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() != CLIENT
        for line in stray_calls(path.read_text())
    }
    assert found == {}, "run Slurm's commands through hpkit.slurm.client (add a function there): " + str(
        found
    )


@pytest.mark.parametrize(
    "code",
    [
        'subprocess.run(["scontrol", "show", "hostnames", nodes])',
        'read.command(("squeue", "--json"))',
        'shutil.which("sacct")',
        'run_cmd(["sinfo", "-h"], timeout, env)',
        'subprocess.check_output(f"scontrol show node {node}", shell=True)',
        'os.system("scancel 12")',
        'args = ["sbatch", "--parsable", script]',
    ],
)
def test_the_rule_sees_each_way_of_running_one(code):
    assert stray_calls(code) == [1]


@pytest.mark.parametrize(
    "code",
    [
        'command = "sbatch" if sbatch else "srun"',
        'print("scontrol show job 12 said nothing")',
        'subprocess.run(["srun", "--overlap", "true"])',
        'known = SBATCH_OPTIONS if command == "sbatch" else SRUN_OPTIONS',
    ],
)
def test_the_rule_leaves_words_that_run_nothing(code):
    assert stray_calls(code) == []


def test_node_addr_from_scontrol_show_node():
    out = "NodeName=node1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=localhost Port=6818"
    assert client.node_addr(out) == "127.0.0.1"
    assert client.node_addr("NodeName=node1 State=IDLE") is None
    assert client.node_addr("NodeName=node1 NodeAddr=(null) State=DOWN") is None
    assert client.node_addr("NodeName=node1 OldNodeAddr=10.0.0.9 State=IDLE") is None


def _script(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def test_a_missing_command_is_one_line_naming_it(tmp_path):
    env = {"PATH": str(tmp_path)}
    answer = client.show_config(env)
    assert answer.missing and answer.rc is None
    with pytest.raises(SlurmError, match=r"^scontrol not found: run on a Slurm login node"):
        client.raise_for(answer)


def test_a_failure_names_the_command_and_slurms_last_line(tmp_path):
    _script(
        tmp_path,
        "sinfo",
        'echo "sinfo: error: one" >&2; echo "sinfo: fatal: Could not establish a configuration source" >&2; exit 1',
    )
    with pytest.raises(SlurmError) as caught:
        client.version({"PATH": str(tmp_path)})
    assert str(caught.value) == (
        "sinfo --version failed: sinfo: fatal: Could not establish a configuration source; point SLURM_CONF at the "
        "cluster's slurm.conf (the local cluster's is .dev-cluster/etc/slurm.conf after `make cluster-up`)"
    )


def test_a_command_past_its_timeout_is_reported_not_raised(tmp_path):
    _script(tmp_path, "scontrol", "exec sleep 30")
    answer = client.show_node("node1", {"PATH": str(tmp_path) + ":/usr/bin:/bin"}, timeout_s=0.2)
    assert answer.timed_out and answer.rc is None
    with pytest.raises(SlurmError, match=r"^scontrol show did not answer in 0 s: is slurmctld up\?$"):
        client.raise_for(answer, 0.2)


def test_extra_folders_are_searched_after_path(tmp_path):
    bin_dir = tmp_path / "opt-slurm-bin"
    bin_dir.mkdir()
    _script(bin_dir, "sinfo", 'echo "debug|2|idle"')
    env = {"PATH": str(tmp_path / "nothing")}
    assert not client.installed(env, [], client.SINFO)
    assert client.installed(env, [bin_dir], client.SINFO)
    answer = client.partitions(env, 5, [bin_dir])
    assert answer.ok and answer.out == "debug|2|idle\n"


def test_the_client_is_standard_library_only():
    """The runtime asks the client on compute nodes before torch loads (hpkit.runtime.env): it brings nothing in."""
    import subprocess
    import sys

    code = (
        "import sys, hpkit.runtime.env, hpkit.slurm.client; "
        "print(sorted(m for m in {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) "
        "if not m.startswith(('_', 'hpkit'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_job_steps_but_the_named_one(tmp_path, monkeypatch):
    # squeue -s -o "%i %j": the zygotes' step (resilience.warm_start) outlives the steps the supervisor cancels.
    _script(tmp_path, "squeue", 'printf "7.0 hpkit-warm\\n7.3 bash\\n7.batch batch\\n"')
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert client.job_steps("7") == ["7.0", "7.3", "7.batch"]
    assert client.job_steps("7", except_named="hpkit-warm") == ["7.3", "7.batch"]
