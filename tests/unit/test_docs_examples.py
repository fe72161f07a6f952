"""The examples in README.md and docs/*.md work as written: every YAML block loads as a job spec with the
spec's own model, every `hpkit ...` command line parses with the CLI's own parser, every relative link leads
to a file (and heading) that exists.

How a YAML block is read follows its info string:
- ```yaml                   a whole job spec, loaded as `hpkit submit` loads one (hpkit.spec.JobSpec);
- ```yaml fragment          a part of a spec (a block or a few keys), merged onto slurm/jobs/demo.yaml, or onto
                            the spec that `base=PATH` names, and then loaded the same way;
- ```yaml not-a-spec        YAML that is no job spec: not loaded. Each such block is named in NOT_SPECS below.
Command lines are read from ```bash, ```sh and ```console blocks (in console blocks, the lines after `$ `).
A ```json block that is a SageMaker estimator, followed by a ```yaml block, must import as that spec.
Every file of this repository (`slurm/...`, `tests/...`) and every `hpkit.module.name` a page names exists, and
every `make TARGET` in a shell block is a target.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hpkit.cli import parse
from hpkit.errors import SpecError
from hpkit.jobs.submission import snapshot_text
from hpkit.render import render
from hpkit.sagemaker.convert import convert
from hpkit.sagemaker.estimator import Estimator
from hpkit.spec import JobSpec
from hpkit.validation import parse_document

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_BASE = "slurm/jobs/demo.yaml"
SHELLS = ("bash", "sh", "console")
# An argument naming a file of this repository.
REPO_PATH = r"^(slurm|tests|bench|docker|scripts|python|docs)/"

# Fragments, per page: each is still loaded (merged onto its base), so a wrong key in one fails; the count is
# here so that marking a block `fragment` stays a decision someone made, not a way around the check.
FRAGMENTS = {
    "docs/spec.md": 3,  # Slurm options, a pipeline layout, a mixture of experts
    "docs/checkpoints.md": 1,  # checkpoint.memory
    "docs/stragglers.md": 1,  # train.stragglers and train.prometheus
    "docs/finetuning.md": 4,  # train.data, model.init_from, eval, model.lora
}
# YAML blocks that are no job spec at all, by page: (first line of the block, why it is not one).
NOT_SPECS: dict[str, list[tuple[str, str]]] = {}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    options: tuple[str, ...]  # the info string's words after the language
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced code block of a page, its lines unindented by the fence's own indentation."""
    found, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if m := re.match(r"^(\s*)```(\S*)\s*(.*)$", lines[i]):
            indent, end = len(m.group(1)), i + 1
            while not re.match(r"^\s*```\s*$", lines[end]):
                end += 1
            body = "\n".join(line[indent:] for line in lines[i + 1 : end])
            found.append(Block(page, i + 1, m.group(2), tuple(m.group(3).split()), body))
            i = end
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def merged(base: dict, part: dict) -> dict:
    """`part` over `base`: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in part.items():
        out[key] = (
            merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def load_spec(block: Block) -> None:
    """Load a ```yaml block as a job spec and render its script, as `hpkit render` would; SpecError (one line per
    problem) when it is not one."""
    data = yaml.safe_load(block.text)
    if "fragment" in block.options:
        bases = [o.removeprefix("base=") for o in block.options if o.startswith("base=")]
        base = yaml.safe_load((REPO / (bases[0] if bases else DEFAULT_BASE)).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise SpecError(
                f"{block.where}: a fragment is a mapping of a spec's keys, not {type(data).__name__}"
            )
        data = merged(base, data)
    spec = parse_document(JobSpec, data, block.where)
    render(spec)
    # What the job's ranks read back: the snapshot `hpkit submit` writes must load as the same spec.
    assert parse_document(JobSpec, yaml.safe_load(snapshot_text(spec)), f"{block.where} (snapshot)") == spec


def command_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, command) for each command of a shell block: continuations joined, console output left out."""
    out, pending, start = [], "", 0
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def hpkit_argvs(command: str) -> list[list[str]]:
    """The argument lists given to `hpkit` in one shell command line (also after a wrapper: `srun ... hpkit`)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    argvs, segment = [], []
    for token in [*lexer, ";"]:
        if token and set(token) <= set("|&;<>()"):  # an operator ends a simple command
            if "hpkit" in segment:
                argvs.append(segment[segment.index("hpkit") + 1 :])
            segment = []
        else:
            segment.append(token)
    return argvs


def parse_problem(argv: list[str]) -> str | None:
    """None when `hpkit ARGV` parses; else what the CLI's parser said (it exits on a usage error)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of each Markdown link outside code blocks and code spans."""
    out, fence = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence:
            out += [(n, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))]
    return out


# -- the examples -------------------------------------------------------------------------------------------


def test_every_yaml_block_loads_as_a_job_spec() -> None:
    yaml_blocks = [b for b in all_blocks() if b.lang == "yaml"]
    problems = []
    for block in yaml_blocks:
        if "not-a-spec" in block.options:
            continue
        try:
            load_spec(block)
        except (SpecError, yaml.YAMLError) as exc:
            problems.append(f"{block.where}: {exc}" if not str(exc).startswith(block.where) else str(exc))
    assert not problems, "YAML examples that do not load as written:\n" + "\n".join(problems)
    assert sum("fragment" not in b.options and "not-a-spec" not in b.options for b in yaml_blocks) >= 2


def test_the_blocks_not_loaded_whole_are_few_and_named() -> None:
    fragments, not_specs = {}, {}
    for block in all_blocks():
        page = str(block.page.relative_to(REPO))
        if block.lang == "yaml" and "fragment" in block.options:
            fragments[page] = fragments.get(page, 0) + 1
        if block.lang == "yaml" and "not-a-spec" in block.options:
            not_specs.setdefault(page, []).append(block.text.splitlines()[0])
    assert fragments == FRAGMENTS
    assert not_specs == {page: [first for first, _ in named] for page, named in NOT_SPECS.items()}
    assert sum(FRAGMENTS.values()) <= 12


def test_every_hpkit_command_line_parses() -> None:
    problems, seen = [], 0
    for block in all_blocks():
        if block.lang not in SHELLS:
            continue
        for line, command in command_lines(block):
            for argv in hpkit_argvs(command):
                seen += 1
                missing = [a for a in argv if re.match(REPO_PATH, a) and not (REPO / a).exists()]
                if problem := parse_problem(argv) or (
                    missing and f"no such file in this repository: {missing}"
                ):
                    problems.append(
                        f"{block.page.relative_to(REPO)}:{line}: hpkit {shlex.join(argv)}: {problem}"
                    )
    assert not problems, "command lines the CLI refuses:\n" + "\n".join(problems)
    assert seen >= 20  # the docs hold this many: the reader above found them


def test_each_estimator_imports_as_the_spec_shown_after_it() -> None:
    pairs = [
        (estimator, spec)
        for page in PAGES
        for estimator, spec in zip(blocks(page), blocks(page)[1:], strict=False)
        if estimator.lang == "json" and "entry_point" in estimator.text and spec.lang == "yaml"
    ]
    assert len(pairs) >= 2
    for estimator, spec in pairs:
        imported = convert(parse_document(Estimator, json.loads(estimator.text), estimator.where))
        assert imported.data == yaml.safe_load(spec.text), (
            f"{spec.where}: not what {estimator.where} imports as"
        )


def make_targets() -> set[str]:
    """The targets of the Makefile and the files it includes."""
    text = "".join(
        f.read_text(encoding="utf-8") for f in (REPO / "Makefile", *sorted((REPO / "docker").glob("*.mk")))
    )
    return {t for m in re.finditer(r"^([\w.-][\w .-]*):(?!=)", text, flags=re.M) for t in m.group(1).split()}


def test_every_make_target_named_exists_and_the_readme_keeps_the_two_commands() -> None:
    targets, problems, named = make_targets(), [], set()
    for block in all_blocks():
        if block.lang not in SHELLS:
            continue
        for line, command in command_lines(block):
            words = shlex.split(command, comments=True)
            if words[:1] == ["make"]:
                named |= {w for w in words[1:] if "=" not in w and not w.startswith("-")}
                problems += [
                    f"{block.page.relative_to(REPO)}:{line}: make {w}: no such target"
                    for w in words[1:]
                    if "=" not in w and not w.startswith("-") and w not in targets
                ]
    assert not problems, "\n".join(problems)
    readme = [c for b in blocks(REPO / "README.md") if b.lang in SHELLS for _, c in command_lines(b)]
    assert any(c.startswith("make demo ") for c in readme) and any(c.startswith("make test ") for c in readme)


def python_name_exists(dotted: str) -> bool:
    """Whether `hpkit.a.b.name` is a module of python/, or a name defined at the top of one, read from the source
    (importing would run what the module does on import)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO / "python" / Path(*parts[:cut])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not source.is_file():
            continue
        rest = parts[cut:]
        if not rest:
            return True
        tree = ast.parse(source.read_text(encoding="utf-8"))
        defined = {
            n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        defined |= {
            t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
        }
        defined |= {
            n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        return len(rest) == 1 and rest[0] in defined  # a method (JobWatcher.poll) is not checked
    return False


def test_every_repository_file_and_hpkit_name_the_docs_mention_exists() -> None:
    """`tests/integration/test_lora.py`, `hpkit.jobs.watch.JobWatcher`: each named in prose or code leads to one."""
    problems, seen = [], 0
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            where = f"{page.relative_to(REPO)}:{n}"
            for path in re.findall(
                r"(?<![\w/.-])((?:slurm|tests|bench|docker|scripts|python|docs)/[\w./-]*\w)", line
            ):
                seen += 1
                if not (REPO / path).exists():
                    problems.append(f"{where}: {path}: no such file in this repository")
            for name in re.findall(r"(?<![\w/.-])(hpkit(?:\.\w+)+)", line):
                seen += 1
                if not python_name_exists(name):
                    problems.append(f"{where}: {name}: no such module or name in python/")
    assert not problems, "names in the docs that lead nowhere:\n" + "\n".join(problems)
    assert seen >= 80


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    problems = []
    for page in PAGES:
        for line, target in links(page):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}:{line}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not problems, "links that lead nowhere:\n" + "\n".join(problems)


# -- the reader itself: it must see what it claims to check ---------------------------------------------------


def test_a_broken_example_is_caught() -> None:
    page = REPO / "docs" / "spec.md"
    spec = next(b for b in blocks(page) if b.lang == "yaml" and not b.options)
    load_spec(spec)
    broken = Block(spec.page, spec.line, "yaml", (), spec.text.replace("time_limit:", "time_limt:"))
    with pytest.raises(SpecError, match=r"docs/spec.md:\d+: time_limt"):
        load_spec(broken)
    assert parse_problem(["plan", "job.yaml", "[--instance", "p5.48xlarge]"]) is not None
    assert python_name_exists("hpkit.jobs.watch.JobWatcher") and python_name_exists("hpkit.plan.memory")
    assert not python_name_exists("hpkit.jobs.watch.JobWatch") and not python_name_exists("hpkit.plan.memry")
    assert parse_problem(["submit", "job.yaml", "--wiat"]) is not None
    assert parse_problem(["submit", "job.yaml", "--wait", "--follow"]) is None
    fragment = next(b for b in blocks(page) if "base=slurm/jobs/moe.yaml" in b.options)
    load_spec(fragment)
    # merged onto moe.yaml's 4 ranks, ep 3 cannot split them
    with pytest.raises(SpecError, match=r"docs/spec.md:\d+: parallelism: .* ep=3 .* world size 4"):
        load_spec(Block(page, fragment.line, "yaml", fragment.options, "parallelism: {dp_shard: 2, ep: 3}"))


def test_command_lines_are_read_as_a_shell_reads_them() -> None:
    block = Block(
        REPO, 10, "console", (), "$ srun -p cpu hpkit data prepare a.jsonl \\\n    --out d\nout: hpkit x"
    )
    assert command_lines(block) == [(11, "srun -p cpu hpkit data prepare a.jsonl      --out d")]
    assert hpkit_argvs("hpkit ckpt ls /c   # a comment: hpkit why 1") == [["ckpt", "ls", "/c"]]
    assert hpkit_argvs("hpkit status 7 --json | jq . && hpkit why 7") == [
        ["status", "7", "--json"],
        ["why", "7"],
    ]
    assert hpkit_argvs("pip install 'hpkit[data]'") == []
