"""Checks of output paths shared by the command-line tools (before any work is done)."""

from __future__ import annotations

import os
from pathlib import Path


def blocking_file(path: str | os.PathLike) -> Path | None:
    """The file that prevents ``path`` from being created, or ``None``.

    That is the nearest existing ancestor of ``path`` (``~`` expanded) when it is a file rather
    than a directory (``out.json/x.json`` where ``out.json`` is a file); the callers name their
    option in the error. Missing ancestors are fine: the tools create them.
    """
    for parent in Path(path).expanduser().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None
