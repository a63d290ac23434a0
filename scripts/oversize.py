"""List the classes and functions of the package that are longer than the size limits.

Usage: ``python scripts/oversize.py [--max-class 300] [--max-function 60]`` from the repository
root. Reads the sources of ``rl_tformers/``, ``agents/`` and ``envs/`` with ``ast`` (nothing is
imported) and prints one line per piece over its limit, longest first::

    function   127  envs/loaders.py:456  load_d4rl_hdf5

A piece's length is its lines from the ``def``/``class`` line to its last line, docstring and
comments included (decorators excluded); a method counts for itself and inside its class.
Exit code 0 (a listing, not a check: ``tests/test_package_shape.py`` is the check).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("rl_tformers", "agents", "envs")
MAX_CLASS, MAX_FUNCTION = 300, 60


class Piece(NamedTuple):
    """A class or function of a source file: ``kind`` is ``class`` or ``function``; ``name`` the
    qualified name inside its module (``Class.method``, ``function.inner``)."""

    kind: str
    path: str
    line: int
    name: str
    lines: int

    @property
    def key(self) -> str:
        """``path::name``: how the allow-list of ``tests/test_package_shape.py`` names it."""
        return f"{self.path}::{self.name}"


def _walk(node: ast.AST, path: str, prefix: str) -> Iterator[Piece]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            yield Piece(kind, path, child.lineno, name, child.end_lineno - child.lineno + 1)
            yield from _walk(child, path, name + ".")
        else:
            yield from _walk(child, path, prefix)


def pieces(root: Path = ROOT) -> Iterator[Piece]:
    """Every class and function (methods and nested ones included) of the package's sources."""
    for top in SOURCES:
        for file in sorted((root / top).rglob("*.py")):
            rel = file.relative_to(root).as_posix()
            yield from _walk(ast.parse(file.read_text(encoding="utf-8"), rel), rel, "")


def oversize(root: Path = ROOT, max_class: int = MAX_CLASS, max_function: int = MAX_FUNCTION) -> list[Piece]:
    """The pieces longer than their limit, longest first."""
    over = [p for p in pieces(root) if p.lines > (max_class if p.kind == "class" else max_function)]
    return sorted(over, key=lambda p: (-p.lines, p.key))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-class", type=int, default=MAX_CLASS, help="longest class allowed (lines)")
    parser.add_argument("--max-function", type=int, default=MAX_FUNCTION, help="longest function allowed (lines)")
    args = parser.parse_args()
    for p in oversize(ROOT, args.max_class, args.max_function):
        print(f"{p.kind:<9} {p.lines:>4}  {p.path}:{p.line}  {p.name}")


if __name__ == "__main__":
    main()
