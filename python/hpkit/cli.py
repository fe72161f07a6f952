"""`hpkit` entry point: dispatches to one module per command, imported only when that command runs.

Commands import their own dependencies lazily so that `hpkit check` on a login node starts fast
and works without torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command -> (module, one-line help). Each module exposes main(argv, prog) -> exit code and
# parse_args(argv, prog) -> argparse.Namespace, what main reads its command line with.
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("hpkit.commands.check", "check whether this node can run distributed training"),
    "render": ("hpkit.commands.jobs", "render a job spec to an sbatch script (dry run)"),
    "submit": ("hpkit.commands.jobs", "render and submit a job spec"),
    "status": ("hpkit.commands.jobs", "show a job's state"),
    "wait": ("hpkit.commands.jobs", "wait for a job to end, showing progress"),
    "logs": ("hpkit.commands.jobs", "print (or follow) a job's output"),
    "cancel": ("hpkit.commands.jobs", "cancel a job and its steps"),
    "why": ("hpkit.commands.why", "say why a job ended, with the log lines that show it"),
    "train": ("hpkit.commands.train", "run the training loop (inside a job)"),
    "plan": (
        "hpkit.commands.plan",
        "rank the layouts a model can run with on N nodes by predicted memory and speed; judge a spec's",
    ),
    "data": ("hpkit.commands.data", "prepare token data: text/JSONL/Parquet -> token shards (hpkit[data])"),
    "ckpt": (
        "hpkit.commands.ckpt",
        "verify or list checkpoints against their commit records; export one as a Hugging Face model",
    ),
    "plot": ("hpkit.commands.plot", "plot training curves or collective bandwidth to PNG/SVG (hpkit[plot])"),
    "bench": (
        "hpkit.commands.bench",
        "benchmarks: collective bandwidth; nccl-tests scripts and their output",
    ),
    "image": (
        "hpkit.commands.image",
        "build, tag and export the training image through the Docker Engine API",
    ),
    "import-sagemaker": (
        "hpkit.sagemaker.importer",
        "turn a SageMaker estimator description into a job spec",
    ),
}

USAGE_EXIT = 2
SIGPIPE_EXIT = 128 + 13  # what a shell reports for a program killed by SIGPIPE


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: hpkit COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `hpkit COMMAND --help` for a command's options."]
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    """Read `hpkit ARGV` as `main` would, without running the command (the docs' examples are checked with
    it). A usage error exits 2 after one message, as argparse does; argv[0] is the command."""
    if not argv or argv[0] not in COMMANDS:
        print(f"hpkit: unknown command {argv[0] if argv else ''!r}\n\n{_usage()}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT)
    name = argv[0]
    return importlib.import_module(COMMANDS[name][0]).parse_args(argv, prog=f"hpkit {name}")


def main(argv: list[str] | None = None) -> int:
    from hpkit.errors import HpkitError

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else USAGE_EXIT
    if argv[0] in ("-V", "--version"):
        from hpkit import __version__

        print(f"hpkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hpkit: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return USAGE_EXIT
    module = importlib.import_module(COMMANDS[name][0])
    try:
        code = int(module.main([name, *rest], prog=f"hpkit {name}") or 0)
        sys.stdout.flush()  # here, not at exit: a reader that went away is then caught below
        return code
    except BrokenPipeError:
        # `hpkit ... | head`: the reader has what it wanted. Exit as a program killed by SIGPIPE would, silently;
        # stdout goes to /dev/null so that the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    except HpkitError as exc:
        print(f"hpkit {name}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if name == "train":
            raise  # a training run's failure keeps its traceback: `hpkit why` names the file and line from it
        # A path the command could not create, read or write (`--out /proc/x`, a full disk): the system's own
        # words name the path and the reason, in one line.
        print(f"hpkit {name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hpkit {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
