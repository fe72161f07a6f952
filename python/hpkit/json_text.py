"""JSON read from files that may be torn, corrupt or hostile (commit records, events, boards, budgets, job notes).

Every reader of such a file catches ValueError, the error of malformed JSON; but the standard parser raises
RecursionError for a document nested past the interpreter's limit (`[[[[...` twenty thousand deep), which none
of them caught: `hpkit ckpt ls` over such a commit record ended in a traceback. `loads` makes it malformed JSON too.
"""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """json.loads; a document nested too deeply to parse raises json.JSONDecodeError (a ValueError), as malformed
    JSON does."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", "", 0) from None
