"""``rl-tformers bench ...``: the benchmark command group.

The group is assembled from the modules of :mod:`rl_tformers.bench`: every module that defines
``register(bench_app)`` adds its sub-commands (``bench attention``, ``bench reversible``, ...),
so a new benchmark is one new module and no edit here.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import typer

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: each reports ratios against a baseline measured in the same run.",
    no_args_is_help=True,
)


def emit_result(data: Mapping[str, Any], table: str, notes: Iterable[str] = (), *, out: str | None = None,
                as_json: bool = False) -> None:
    """Print a benchmark's result the way every ``bench`` command does.

    Args:
        data: the JSON-serialisable result (``Result.as_dict()``).
        table: its markdown rendering, printed unless ``as_json``.
        notes: remarks printed to stderr as ``note: ...`` lines (peers left out, ...).
        out: also write ``data`` as indented JSON to this path (parent folders are created).
        as_json: print ``data`` as JSON instead of the table.
    """
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(data, indent=2))
    typer.echo(json.dumps(data, indent=2) if as_json else table)
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def bench_modules() -> list[str]:
    """Names of the benchmark modules (every public submodule of rl_tformers.bench but this one)."""
    import rl_tformers.bench as pkg

    return [
        f"{pkg.__name__}.{m.name}"
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
        if not m.name.startswith("_") and m.name != "commands"
    ]


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group to the root app, with every module's commands."""
    for name in bench_modules():
        hook = getattr(importlib.import_module(name), "register", None)
        if hook is not None:
            hook(bench_app)
    app.add_typer(bench_app, name="bench")
