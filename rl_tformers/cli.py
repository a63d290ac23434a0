"""Command line: ``rl-tformers <command> [options] [key=value overrides]``.

Built with Typer (click underneath): typed options, ``--help`` on every command, shell-safe
parsing. Configs are YAML files merged with dotted ``key=value`` overrides by OmegaConf (see
``rl_tformers.runtime.config``).

Each command group lives in its own module and registers itself here through a
``register(app)`` function, so the command surface is assembled from the packages that own
the logic (training in ``runtime``, datasets in ``envs``, agents' eval/plot in ``agents``...).
Modules listed in ``COMMAND_MODULES`` that are not present yet are skipped.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import typer

app = typer.Typer(
    name="rl-tformers",
    help="Offline RL with Transformers: Decision Transformer and GTrXL on a swappable backbone library.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

#: Modules that own a part of the command line; each defines ``register(app: typer.Typer)``.
COMMAND_MODULES = (
    "rl_tformers.runtime.commands",  # train, sweep
    "rl_tformers.agents.commands",  # eval, plot, demo
    "rl_tformers.envs.commands",  # collect, dataset
    "rl_tformers.commands_backbones",  # backbones
    "rl_tformers.bench.commands",  # bench
)


@app.callback()
def _root() -> None:
    """Offline RL with Transformers: Decision Transformer and GTrXL on a swappable backbone library."""


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part of the CLI has not landed
            raise
        mod.register(app)


_register_all()


def _our_dirs() -> tuple[str, ...]:
    import rl_tformers
    import rl_tformers.agents
    import rl_tformers.envs

    return tuple(str(Path(d).resolve()) + os.sep
                 for m in (rl_tformers, rl_tformers.agents, rl_tformers.envs) for d in m.__path__)


def short_warnings() -> None:
    """Print the package's own warnings as one ``warning: MESSAGE`` line on stderr (no source
    file, line number or source text, which only help a developer); third-party warnings keep
    Python's format."""
    import warnings

    ours, plain = _our_dirs(), warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        if str(Path(filename).resolve()).startswith(ours):
            return f"warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def main() -> None:
    short_warnings()
    app()


if __name__ == "__main__":
    main()
