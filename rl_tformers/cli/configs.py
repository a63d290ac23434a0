"""``rl-tformers configs [PATTERN]``: the shipped configs, one line each (name, agent kind, data,
what it reproduces), read from the files themselves (:func:`rl_tformers.runtime.run_config.config_summary`)."""

from __future__ import annotations

import fnmatch
import json

import typer


def configs(
    pattern: str = typer.Argument(None, help="Only the configs whose name matches this glob (e.g. 'dt/*')."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list (name, agent, data, description, path)."),
) -> None:
    """List the shipped configs: name (for -c), agent kind, data it trains on, and the first sentence of its header comment.

    \b
    Examples:
      rl-tformers configs
      rl-tformers configs 'memory/*'
      rl-tformers train -c memory/recall32_xl
    """
    import difflib

    from rl_tformers.runtime.errors import ConfigError
    from rl_tformers.runtime.run_config import available_configs, config_summary

    names = available_configs()
    chosen = [n for n in names if pattern is None or fnmatch.fnmatchcase(n, pattern)]
    if not chosen:
        close = difflib.get_close_matches(pattern, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; the groups are {', '.join(_groups(names))}"
        typer.echo(f"error: no shipped config matches {pattern!r}{hint}", err=True)
        raise typer.Exit(2)
    try:
        rows = [config_summary(n) for n in chosen]
    except ConfigError as exc:  # a packaged file that does not parse: the installation is damaged
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    w_name, w_agent, w_data = (max(len(getattr(r, k)) for r in rows) for k in ("name", "agent", "data"))
    for r in rows:
        typer.echo(f"{r.name:{w_name}s}  {r.agent:{w_agent}s}  {r.data:{w_data}s}  {r.description}".rstrip())


def _groups(names: list[str]) -> list[str]:
    """``['bc/*', 'dt/*', ...]``: the folders of the shipped configs, as patterns."""
    return sorted({f"{n.split('/', 1)[0]}/*" for n in names if "/" in n})


def register(app: typer.Typer) -> None:
    app.command("configs")(configs)
