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


#: The path separators of this platform (``/``, and ``\\`` on Windows).
SEPARATORS = os.sep + (os.altsep or "")


def directory_ending(text: str) -> str | None:
    """The ending that makes the path ``text`` name a directory, or ``None``: a trailing path
    separator (``dir.png/``) or a last component ``.`` / ``..`` (``figs/.``, ``new/..``).

    Output options take such text as a ``str``, not a ``Path``: ``Path("dir.png/")`` drops the
    separator, and a tool would then write a file ``dir.png``. The callers name their option
    and an example file in the error.
    """
    if text.endswith(tuple(SEPARATORS)):
        return text[-1]
    last = os.path.basename(text)
    return last if last in (".", "..") else None
