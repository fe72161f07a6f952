"""Parse /proc/self/mountinfo: the one source that tells a bind mount (its root field) from a plain mount."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hpkit.checks.probe import read_text

# Filesystems that the nodes of a cluster can share; a checkpoint folder on anything else is per node.
SHARED_FS_TYPES = frozenset(
    {"lustre", "nfs", "nfs4", "efs", "beegfs", "gpfs", "cifs", "smb3", "ceph", "fuse.s3fs"}
)

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as octal escapes (\040 …).
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class Mount:
    root: (
        str  # the folder of the source filesystem that appears here: not "/" for a bind mount of a subfolder
    )
    mount_point: str
    options: tuple[str, ...]
    fstype: str
    source: str

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 6 or len(fields) < sep + 3:
            continue
        mounts.append(
            Mount(
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=tuple(fields[5].split(",")),
                fstype=fields[sep + 1],
                source=_unescape(fields[sep + 2]),
            )
        )
    return mounts


def read_mounts(proc: Path) -> list[Mount] | None:
    text = read_text(proc / "self" / "mountinfo")
    return None if text is None else parse_mountinfo(text)


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount that holds path: the last-mounted one with the longest matching mount point."""
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point.rstrip("/") or "/"
        inside = path == point or path.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    return best
