"""``rl-tformers agents [KIND]``: every registered agent kind's ``agent.*`` options, with their
defaults, one-line docs and allowed values, generated from the kind's config dataclass."""

from __future__ import annotations

import typer

from rl_tformers.runtime import agent_registry
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.plugins import load_entry_point_plugins
from rl_tformers.typed_config import format_fields


def agents(kind: str = typer.Argument(None, help="Only this agent kind (e.g. dt).")) -> None:
    """List the agent kinds and their agent.* options: key = default, doc (allowed values)."""
    load_entry_point_plugins()  # the agents of installed rl_tformers.plugins packages are listed too
    try:
        kinds = [agent_registry.get_agent(kind).kind] if kind else agent_registry.available_agents()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for i, name in enumerate(kinds):
        entry = agent_registry.get_agent(name)
        if i:
            typer.echo("")
        typer.echo(f"{name}: {entry.description}")
        if entry.config_cls is None:
            typer.echo("  (no typed options: the kind declares its agent.* keys with its registered defaults)")
            continue
        for line in format_fields(entry.config_cls, "agent"):
            typer.echo(f"  {line}")


def register(app: typer.Typer) -> None:
    app.command("agents")(agents)
