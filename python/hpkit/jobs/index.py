"""A note per job that `hpkit submit` made: where its script and working directory are.

The controller forgets a job MinJobAge seconds after it ends. After that the job-completion log has no
script path, and slurmdbd keeps the script only where AccountingStoreFlags=job_script is set. The note
lets `hpkit status` and `hpkit plot` find an old job's metrics and checkpoints. It is a small JSON file
per job in $HPKIT_STATE_DIR/jobs (default $XDG_STATE_HOME/hpkit/jobs, else ~/.local/state/hpkit/jobs), in
the user's home: on a cluster that is the shared filesystem, so every login node sees it.

Job ids restart when a cluster is rebuilt; a note whose job name differs from Slurm's is not used.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hpkit import json_text


@dataclass(frozen=True)
class JobNote:
    job_id: str
    name: str
    script: str
    workdir: str


def index_dir() -> Path:
    explicit = os.environ.get("HPKIT_STATE_DIR")
    if explicit:
        return Path(explicit) / "jobs"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "hpkit" / "jobs"


def remember(note: JobNote) -> str | None:
    """Write the note; returns why it could not be written (the job is submitted either way)."""
    path = index_dir() / f"{note.job_id}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(asdict(note)) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def recall(job_id: str, name: str | None = None) -> JobNote | None:
    """The note for `job_id`, if there is one whose job name is `name` (when given)."""
    if not job_id.isdigit():
        return None
    try:
        data = json_text.loads((index_dir() / f"{job_id}.json").read_text(encoding="utf-8"))
        note = JobNote(**{k: str(data[k]) for k in ("job_id", "name", "script", "workdir")})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if note.job_id != job_id or (name is not None and note.name != name):
        return None
    return note
