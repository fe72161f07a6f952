"""Users' Python programs run through `python -m hpkit.run_script` (hpkit.slurm.script.user_command): exactly as run
directly, plus the exit hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpkit.slurm.job import SlurmJob
from hpkit.slurm.script import user_command
from hpkit.validation import parse_document

REPO = Path(__file__).resolve().parents[2]

PROBE = """\
import atexit, json, sys
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
                  "hooks": atexit._ncallbacks()}))
if sys.argv[1:] == ["boom"]:
    raise ValueError("from the script")
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
"""


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO / "python"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("args", [[], ["7"], ["boom"]])
def test_a_script_sees_what_it_sees_run_directly_and_gets_the_exit_hook(tmp_path, args):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    direct = _run(str(script), *args, cwd=tmp_path)
    wrapped = _run("-m", "hpkit.run_script", str(script), *args, cwd=tmp_path)
    assert wrapped.returncode == direct.returncode
    import json

    seen, seen_direct = json.loads(wrapped.stdout), json.loads(direct.stdout)
    assert seen["hooks"] == seen_direct["hooks"] + 1  # hpkit.exit_settle's, and nothing else differs
    assert {k: v for k, v in seen.items() if k != "hooks"} == {
        k: v for k, v in seen_direct.items() if k != "hooks"
    }
    assert ("ValueError: from the script" in wrapped.stderr) == ("ValueError" in direct.stderr)


def test_a_module_runs_as_with_python_m(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    direct = _run("-m", "probe_mod", "3", cwd=tmp_path)
    wrapped = _run("-m", "hpkit.run_script", "-m", "probe_mod", "3", cwd=tmp_path)
    assert (wrapped.returncode, direct.returncode) == (3, 3)
    import json

    seen, seen_direct = json.loads(wrapped.stdout), json.loads(direct.stdout)
    assert (seen["name"], seen["argv"], seen["path0"]) == (
        seen_direct["name"],
        seen_direct["argv"],
        seen_direct["path0"],
    )


def _spec(command: list[str], **extra) -> SlurmJob:
    return parse_document(SlurmJob, {"name": "t", "command": command, **extra})


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["python", "train.py", "--lr", "1"], ["python", "-m", "hpkit.run_script", "train.py", "--lr", "1"]),
        (["python3", "-u", "train.py"], ["python3", "-u", "-m", "hpkit.run_script", "train.py"]),
        (["/v/bin/python3.11", "-W", "ignore", "t.py"], ["/v/bin/python3.11", "-W", "ignore", "-m", "hpkit.run_script", "t.py"]),
        (["python", "-m", "pkg.train", "x"], ["python", "-m", "hpkit.run_script", "-m", "pkg.train", "x"]),
        (["python", "-c", "print(1)"], ["python", "-c", "print(1)"]),
        # hpkit's own script is `python3 -m hpkit` (python3 from the task's PATH, as the supervisor's)
        (["hpkit", "train", "--config", "c.yaml"], ["python3", "-m", "hpkit.run_script", "-m", "hpkit", "train", "--config", "c.yaml"]),
        (["/opt/bin/hpkit", "train"], ["/opt/bin/hpkit", "train"]),  # by a path: which Python it names is unknown
        (["bash", "run.sh"], ["bash", "run.sh"]),
    ],
)  # fmt: skip
def test_python_programs_are_launched_through_the_wrapper(command, expected):
    assert user_command(_spec(command)) == expected


def test_in_a_container_without_compat_the_command_runs_as_written():
    # hpkit may not be in a foreign image: only compat (which needs hpkit there anyway) wraps it.
    image = {"image": "nvcr.io#nvidia/pytorch:24.07-py3"}
    assert user_command(_spec(["python", "t.py"], container=image)) == ["python", "t.py"]
    wrapped = user_command(_spec(["python", "t.py"], container=image, compat=["smddp"]))
    assert wrapped == ["python", "-m", "hpkit.run_script", "t.py"]
