"""Hostile specs, generated: no string from a spec is ever executed by the rendered script.

Each generated spec carries payloads that would create a canary file if any shell evaluated them.
A spec is either refused with a SpecError or rendered to a script that passes `bash -n` and, run
with harmless stand-ins for srun and scontrol, hands every value to the program unchanged.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpkit.errors import SpecError
from hpkit.render import render
from hpkit.spec import parse_spec

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
]
# Text around the payloads: quotes, shell syntax, control characters and non-ASCII.
SHELL_CHARS = list("ab \t\n'\"`$(){}[];&|<>!*?~#\\%=,:/.-_")
NOISE = st.text(alphabet=st.sampled_from([*SHELL_CHARS, "é", "漢", "🚀", "\u202e"]), max_size=6)
HOSTILE = st.builds(lambda a, p, b: a + p + b, NOISE, st.sampled_from(INJECTIONS), NOISE)
MAYBE = st.one_of(st.none(), HOSTILE)

FAKE_SRUN = """#!/bin/bash
# Stands in for srun: records its arguments and environment, NUL-separated, runs nothing.
printf '%s\\0' "$@" >"$RECORD.argv"
env -0 >"$RECORD.env"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$2" in hostnames) printf 'node1\\nnode2\\n';; node) echo 'NodeName=node1 NodeAddr=10.0.0.1';; esac
"""


@st.composite
def hostile_specs(draw) -> dict:
    spec = {
        "name": draw(st.one_of(st.just("job"), HOSTILE)),
        "nodes": 2,
        "tasks_per_node": 2,
        "launcher": draw(st.sampled_from(["torchrun", "srun"])),
        "env": draw(st.dictionaries(st.sampled_from(["A", "B_2", "NCCL_DEBUG"]), HOSTILE, max_size=3)),
        "command": [
            draw(st.sampled_from(["prog", "python3"])),
            *draw(st.lists(HOSTILE, min_size=1, max_size=4)),
        ],
    }
    for field in ("partition", "account", "qos", "time_limit", "output_dir", "workdir"):
        value = draw(MAYBE)
        if value is not None:
            spec[field] = value
    if draw(st.booleans()):
        spec["container"] = {
            "image": draw(HOSTILE),
            "mounts": draw(st.lists(st.builds(lambda s: f"/a{s}:/b", HOSTILE), max_size=2)),
        }
        if draw(st.booleans()):
            spec["container"]["workdir"] = draw(HOSTILE)
    return spec


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    CANARY_DIR.mkdir(parents=True, exist_ok=True)
    return bin_dir


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hostile_specs())
def test_generated_hostile_specs_never_execute(stand_ins, tmp_path, data):
    try:
        spec = parse_spec(data)
    except SpecError as exc:
        assert "\n" not in str(exc).strip() or all(
            line.startswith("spec: ") for line in str(exc).splitlines()
        )
        return
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec))
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr

    record = tmp_path / "record"
    env = {
        "PATH": f"{stand_ins}:/usr/bin:/bin",
        "RECORD": str(record),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_CPUS_ON_NODE": "4",
    }
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not CANARY.exists(), f"a payload ran: {data}"

    argv = record.with_suffix(".argv").read_bytes().split(b"\0")[:-1]
    argv = [a.decode() for a in argv]
    assert argv[-len(spec.command) :] == spec.command
    seen_env = dict(
        item.decode().split("=", 1)
        for item in record.with_suffix(".env").read_bytes().split(b"\0")
        if b"=" in item
    )
    for key, value in spec.env.items():
        assert seen_env[key] == value
    if spec.container:
        assert f"--container-image={spec.container.image}" in argv
