"""``rl-tformers bench ...``: the benchmark command group.

The group is assembled from the modules of :mod:`rl_tformers.bench`: every module that defines
``register(bench_app)`` adds its sub-commands (``bench attention``, ``bench reversible``, ...),
so a new benchmark is one new module and no edit here.
"""

from __future__ import annotations

import importlib
import pkgutil

import typer

from rl_tformers.bench.options import (  # noqa: F401  (the helpers every bench module uses)
    check_counts,
    check_device,
    check_out,
    emit_result,
    fail,
    first_repeat,
    run_checked,
)

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: each reports ratios against a baseline measured in the same run.",
    no_args_is_help=True,
)


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
