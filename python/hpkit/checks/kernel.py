"""The Linux kernel release. Nothing here fails: the release is a fact to compare across nodes (one node
booted into another kernel after a patch run has different drivers and EFA modules than its peers)."""

from __future__ import annotations

from hpkit.checks.context import Context
from hpkit.checks.probe import read_text
from hpkit.checks.registry import check
from hpkit.checks.result import Result


@check("kernel", "Linux kernel release", profiles=("compute", "container"))
def kernel(ctx: Context) -> Result:
    path = ctx.roots.proc / "sys" / "kernel" / "osrelease"
    release = (read_text(path) or "").strip() or None
    if release is None:
        return Result.warn(f"cannot read {path}", "run the check where /proc is mounted").with_facts(
            kernel=None
        )
    return Result.ok(f"Linux {release}").with_facts(kernel=release)
