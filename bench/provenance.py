"""Which code a benchmark result came from: the one home of the ``commit`` field of every bench JSON.

A device machine runs a copy of the tree whose ``.git`` (when one travels at all) may be older than the
files beside it, so a commit named by the caller in ``$ARTCACHE_COMMIT`` wins over what ``git`` reports.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["source_commit"]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def source_commit() -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the code running now.

    ``commit``: ``$ARTCACHE_COMMIT`` when set (the sender of a copied tree names it), else ``git rev-parse
    HEAD`` of this checkout, else ``"unknown"``. ``dirty``: tracked files differ from that commit (``git
    status --porcelain --untracked-files=no``); None when it cannot be told (no git, or git's HEAD is not the
    named commit); False for a named commit outside any checkout (the sender vouches for it).
    """
    named = os.environ.get("ARTCACHE_COMMIT") or None
    head = _git("rev-parse", "HEAD")
    commit = named or head or "unknown"
    if head is None:
        return commit, False if named else None
    if named and head != named:
        return commit, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)
